// Linears over a GGUF file's own quantized blocks (dtype "gguf"): the bytes as stored, never
// re-quantized or dequantized into a copy. The block layouts are ggml's published ones:
//   Q4_0  32 values, 18 B: f16 d, 16 B nibbles           w = d * (q - 8)
//   Q4_1  32 values, 20 B: f16 d, f16 m, 16 B nibbles    w = d * q + m
//   Q5_0  32 values, 22 B: f16 d, u32 high bits, 16 B     w = d * (q - 16)
//   Q5_1  32 values, 24 B: f16 d, f16 m, u32, 16 B        w = d * q + m
//   Q8_0  32 values, 34 B: f16 d, 32 int8                 w = d * q
//   Q4_K 256 values, 144 B: f16 d, f16 dmin, 12 B of 6-bit scale / min pairs (8 sub-blocks of
//        32), 128 B nibbles                              w = d * sc * q - dmin * m
//   Q5_K 256 values, 176 B: as Q4_K + 32 B of fifth bits
//   Q6_K 256 values, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (per
//        16 values), f16 d                              w = d * sc * (q - 32)
// (Element order within a block: ggml's, e.g. Q4_K's 64-value chunk c holds values 64c..64c+31
// in the low nibbles of its 32 bytes and 64c+32..64c+63 in the high ones.)
//
// Every block type is first decoded into one shape: an unsigned integer q per value (the
// stored one; Q8_0's signed byte as is), an integer scale sc and min mn per 16 values, and
// two floats per block, so that  w = (d * sc) * q - (dmin * mn)  exactly (gguf_dequant_rows).
//
// Activations: each token's row is quantized per block of the weight's width (32 values
// for the legacy types, 256 for the K types, as llama.cpp's Q8_0 / Q8_K): a = da * qa, qa
// int8 in [-127, 127], da = max|x| / 127, and the sums of qa per 16 values. Then per block:
//   dot = (d * da) * sum_s sc_s * (sum_{i in s} q_i qa_i)  -  (dmin * da) * sum_s mn_s * bsum_s
// The integer parts are exact (AVX2: maddubs + madd); the float parts are accumulated in
// one fixed order per (row, token). A row's weights are decoded once per forward and every
// token then runs the same instruction sequence whatever its batch-mates: one kernel serves
// decoding, verification and prefill, and a token's output never depends on how many
// tokens were scored beside it (batch invariance, tests/test_gguf_native.py).
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Each token's row quantized per block of qk values: qa [N, K] int8 in [-127, 127], da [N, K/qk]
// (max|x| / 127 per block) and bsum [N, K/16] (the sums of qa per 16 values). Shared with
// gguf_packed_rows.cpp.
void gguf_quantize_acts(const float* x, int64_t N, int64_t K, int64_t qk, int8_t* qa, float* da, int16_t* bsum) {
  // a few tokens are quicker on this thread than the other's wake-up: threads from 64K values on
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = x + t * K;
      int8_t* q = qa + t * K;
      for (int64_t b = 0; b < K / qk; ++b) {
        const float* xb = xt + b * qk;
        int8_t* qb = q + b * qk;
        int16_t* sb = bsum + t * (K / 16) + b * (qk / 16);
#if defined(__AVX2__)
        // The scalar loop's operations 8 at a time: max_ps(|x|, amax) keeps amax where x is NaN
        // as std::max(amax, |x|) does; round_ps is nearbyint's current-mode rounding.
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 m = _mm256_setzero_ps();
        for (int64_t i = 0; i < qk; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h);
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
        for (int64_t i = 0; i < qk; i += 16) {
          __m256i v[2];
          for (int j = 0; j < 2; ++j) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), iv), _MM_FROUND_CUR_DIRECTION);
            v[j] = _mm256_cvttps_epi32(_mm256_min_ps(hi, _mm256_max_ps(r, lo)));
          }
          const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);  // 16 int16 in order
          const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), w8);
          __m256i s = _mm256_add_epi32(v[0], v[1]);
          __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
          s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
          s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
          sb[i / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
        }
#else
        float amax = 0.f;
        for (int64_t i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int64_t i = 0; i < qk; ++i) {
          const float v = std::nearbyint(xb[i] * inv);
          qb[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
        for (int64_t s = 0; s < qk / 16; ++s) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += qb[16 * s + i];
          sb[s] = static_cast<int16_t>(sum);
        }
#endif
        da[t * (K / qk) + b] = amax / 127.f;
      }
    }
  });
}

namespace {

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;

struct Layout {
  int64_t qk, bytes;  // values per block, bytes per block
};

constexpr Layout block_layout(int64_t type) {  // {0, 0}: no native kernel
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  return {0, 0};
}

Layout layout_of(int64_t type) {
  const Layout L = block_layout(type);
  TORCH_CHECK(L.qk, "GGUF block type ", type, " has no native kernel");
  return L;
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One decoded block: q[qk], sc and mn per 16 values; returns {d, dmin}.
struct Scales {
  float d, dmin;
};

inline void nibbles32(const uint8_t* qs, uint8_t* q) {  // 16 bytes -> 32 values (low nibbles first)
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 15;
    q[i + 16] = qs[i] >> 4;
  }
}

inline void fifth_bits32(const uint8_t* qh_bytes, uint8_t* q) {  // Q5_0 / Q5_1: bit i of the u32 is value i's
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int i = 0; i < 32; ++i) q[i] |= ((qh >> i) & 1) << 4;
}

inline void k_scale_min(const uint8_t* s, int j, int16_t& sc, int16_t& mn) {  // Q4_K / Q5_K 6-bit pairs
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

__attribute__((always_inline)) inline Scales decode_block(int64_t type, const uint8_t* p, uint8_t* q, int16_t* sc, int16_t* mn) {
  switch (type) {
    case Q4_0:
    case Q5_0: {
      const bool five = type == Q5_0;
      nibbles32(p + (five ? 6 : 2), q);
      if (five) fifth_bits32(p + 2, q);
      const float d = f16(p);
      sc[0] = sc[1] = 1;
      mn[0] = mn[1] = five ? 16 : 8;
      return {d, d};
    }
    case Q4_1:
    case Q5_1: {
      const bool five = type == Q5_1;
      nibbles32(p + (five ? 8 : 4), q);
      if (five) fifth_bits32(p + 4, q);
      sc[0] = sc[1] = 1;
      mn[0] = mn[1] = 1;
      return {f16(p), -f16(p + 2)};
    }
    case Q8_0:
      std::memcpy(q, p + 2, 32);
      sc[0] = sc[1] = 1;
      mn[0] = mn[1] = 0;
      return {f16(p), 0.f};
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      const uint8_t* qs = p + (five ? 48 : 16);
      const uint8_t* qh = p + 16;
      for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
          uint8_t lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          q[64 * c + l] = lo;
          q[64 * c + 32 + l] = hi;
        }
      }
      for (int j = 0; j < 8; ++j) {
        int16_t s, m;
        k_scale_min(p + 4, j, s, m);
        sc[2 * j] = sc[2 * j + 1] = s;
        mn[2 * j] = mn[2 * j + 1] = m;
      }
      return {f16(p), f16(p + 2)};
    }
    case Q6_K: {
      const uint8_t *ql = p, *qh = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      for (int h = 0; h < 2; ++h) {
        for (int e = 0; e < 128; ++e) {
          const uint8_t lo = e < 64 ? (ql[64 * h + e] & 15) : (ql[64 * h + e - 64] >> 4);
          const uint8_t hi = (qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
          q[128 * h + e] = lo | (hi << 4);
        }
      }
      for (int s = 0; s < 16; ++s) {
        sc[s] = scales[s];
        mn[s] = static_cast<int16_t>(32 * scales[s]);
      }
      const float d = f16(p + 208);
      return {d, d};
    }
  }
  TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
}

#if defined(__AVX2__)
// The same decoding with AVX2 (the scalar decode_block is the definition; the tests compare
// both through gguf_dequant_rows against gguf's reference).
inline __m256i nibbles32_avx2(const uint8_t* qs) {  // 16 bytes -> 32 values, low nibbles first
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

inline __m256i bits32_avx2(const uint8_t* qh_bytes) {  // bit i of the u32 -> 16 in byte i, else 0
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Writes q[qk] (the scalar decode's values); sc / mn / {d, dmin} still come from decode_block's
// scalar part, which is cheap beside the values.
__attribute__((always_inline)) inline bool decode_values_avx2(int64_t type, const uint8_t* p, uint8_t* q) {
  auto store = [](uint8_t* dst, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); };
  const __m256i m4 = _mm256_set1_epi8(15);
  switch (type) {
    case Q4_0: store(q, nibbles32_avx2(p + 2)); return true;
    case Q4_1: store(q, nibbles32_avx2(p + 4)); return true;
    case Q5_0: store(q, _mm256_or_si256(nibbles32_avx2(p + 6), bits32_avx2(p + 2))); return true;
    case Q5_1: store(q, _mm256_or_si256(nibbles32_avx2(p + 8), bits32_avx2(p + 4))); return true;
    case Q8_0: store(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))); return true;
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      const uint8_t* qs = p + (five ? 48 : 16);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (five) {
          const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * c))), b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
          const __m256i sixteen = _mm256_set1_epi8(16);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        store(q + 64 * c, lo);
        store(q + 64 * c + 32, hi);
      }
      return true;
    }
    case Q6_K: {
      const __m256i m2 = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
        uint8_t* o = q + 128 * h;
        store(o, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)));
        store(o + 32, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)));
        store(o + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)));
        store(o + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                      _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)));
      }
      return true;
    }
  }
  return false;
}
#endif

// Scale / min / {d, dmin} part of decode_block, without the values.
__attribute__((always_inline)) inline Scales decode_scales(int64_t type, const uint8_t* p, int16_t* sc, int16_t* mn) {
  switch (type) {
    case Q4_0: case Q5_0: sc[0] = sc[1] = 1; mn[0] = mn[1] = type == Q5_0 ? 16 : 8; return {f16(p), f16(p)};
    case Q4_1: case Q5_1: sc[0] = sc[1] = 1; mn[0] = mn[1] = 1; return {f16(p), -f16(p + 2)};
    case Q8_0: sc[0] = sc[1] = 1; mn[0] = mn[1] = 0; return {f16(p), 0.f};
    case Q4_K: case Q5_K: {  // k_scale_min for all 8 pairs at once, 4 bytes a word
      uint32_t u[3];
      std::memcpy(u, p + 4, 12);
      const uint32_t sc_words[2] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)};
      const uint32_t mn_words[2] = {u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)};
      uint64_t sc8, mn8;
      std::memcpy(&sc8, sc_words, 8);
      std::memcpy(&mn8, mn_words, 8);
#if defined(__AVX2__)
      const __m128i s16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(sc8)));
      const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc), _mm256_set_m128i(_mm_unpackhi_epi16(s16, s16), _mm_unpacklo_epi16(s16, s16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn), _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16)));
#else
      for (int j = 0; j < 8; ++j) {
        sc[2 * j] = sc[2 * j + 1] = (sc8 >> (8 * j)) & 255;
        mn[2 * j] = mn[2 * j + 1] = (mn8 >> (8 * j)) & 255;
      }
#endif
      return {f16(p), f16(p + 2)};
    }
    case Q6_K: {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      for (int s = 0; s < 16; ++s) {
        sc[s] = scales[s];
        mn[s] = static_cast<int16_t>(32 * scales[s]);
      }
      const float d = f16(p + 208);
      return {d, d};
    }
  }
  TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
}

// Quantized activations of N tokens for blocks of qk: qa [N, K], da [N, K/qk], bsum [N, K/16].
struct Acts {
  int64_t qk = 0;
  std::vector<int8_t> qa;
  std::vector<float> da;
  std::vector<int16_t> bsum;
};

Acts quantize_acts(const float* x, int64_t N, int64_t K, int64_t qk) {
  Acts a;
  a.qk = qk;
  a.qa.resize(N * K);
  a.da.resize(N * (K / qk));
  a.bsum.resize(N * (K / 16));
  gguf_quantize_acts(x, N, K, qk, a.qa.data(), a.da.data(), a.bsum.data());
  return a;
}

// One block decoded for the dot products: its values, and per 32 values the 16 int16 lane
// scales of maddubs's pairs ([sc of values 0-15] x 8, [sc of 16-31] x 8).
struct Block {
  alignas(32) uint8_t q[256];
  alignas(32) int16_t scv[128];
  alignas(32) int16_t sc[16], mn[16];
  float d, dmin;

  __attribute__((always_inline)) void decode(int64_t type, const uint8_t* p, int64_t qk, bool vector) {
    Scales s;
#if defined(__AVX2__)
    if (vector && decode_values_avx2(type, p, q))
      s = decode_scales(type, p, sc, mn);
    else
#endif
      s = decode_block(type, p, q, sc, mn);
    d = s.d;
    dmin = s.dmin;
    if (type != Q6_K) return;  // scale 1, or one per 32 values: the dot broadcasts it
#if defined(__AVX2__)
    for (int g = 0; g < 16; g += 2)
      _mm256_store_si256(reinterpret_cast<__m256i*>(scv + 8 * g),
                         _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g])));
#else
    for (int i = 0; i < 128; ++i) scv[i] = sc[i / 8];
#endif
  }
};

// Per (row, token): the running sums of the scale part and of the min part.
#if defined(__AVX2__)
struct Sums {
  __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
  float macc1 = 0.f;  // the legacy types' min part (one integer per block)
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// A block's integer dot product for 32 of its values at offset o is
// madd(pair_sums(values, activations), lane_scales(o)): 8 int32 lanes, exact (the pairs' sums stay
// inside int16: at most 2 x 63 x 127, or 2 x 128 x 127 for Q8_0's signed bytes).
template <int64_t QK, bool PER16>
inline __m256i lane_scales(const Block& w, int64_t o) {
  return QK == 32 ? _mm256_set1_epi16(1)
         : PER16  ? _mm256_load_si256(reinterpret_cast<const __m256i*>(w.scv + o / 2))
                  : _mm256_set1_epi16(w.sc[o / 16]);
}

template <bool SIGNED>
inline __m256i pair_sums(__m256i v, __m256i x) {
  return SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v)) : _mm256_maddubs_epi16(v, x);
}

// The float part of block b for one (row, token), given the block's integer sums: the same
// operations in the same order for every token, whichever loop computed isum.
template <int64_t QK, bool SIGNED>
inline void block_float(const Block& w, __m256i isum, float da, const int16_t* bsum, Sums& s) {
  s.acc = _mm256_add_ps(s.acc, _mm256_mul_ps(_mm256_set1_ps(w.d * da), _mm256_cvtepi32_ps(isum)));
  if (SIGNED) return;
  if (QK == 32) {
    s.macc1 += (w.dmin * da) * float(int32_t(w.mn[0]) * (int32_t(bsum[0]) + int32_t(bsum[1])));
  } else {
    const __m256i m = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.mn)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
    s.macc = _mm256_add_ps(s.macc, _mm256_mul_ps(_mm256_set1_ps(w.dmin * da), _mm256_cvtepi32_ps(m)));
  }
}

// R rows x T tokens of block b at once (a register tile): each token's activations loaded once
// for R rows, each row's values once for T tokens. Every (row, token) gets the same integer lanes
// and then block_float, so its bits depend on neither R, T nor the tile it falls in.
template <int64_t QK, bool SIGNED, bool PER16, int R, int T>
inline void tile_dot(const Block* w, const int8_t* const* qa, const float* da, const int16_t* const* bsum,
                     Sums* const* s) {
  __m256i isum[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
  for (int64_t o = 0; o < QK; o += 32) {
    __m256i v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].q + o));
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa[t] + o));
      for (int r = 0; r < R; ++r)
        isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_madd_epi16(pair_sums<SIGNED>(v[r], x), lane_scales<QK, PER16>(w[r], o)));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) block_float<QK, SIGNED>(w[r], isum[r][t], da[t], bsum[t], s[r][t]);
}

inline float finish(const Sums& s) { return hsum(s.acc) - (hsum(s.macc) + s.macc1); }
#else
struct Sums {
  float acc = 0.f, macc = 0.f;
};

template <int64_t QK, bool SIGNED, bool PER16>
inline void block_dot(const Block& w, const int8_t* qa, float da, const int16_t* bsum, Sums& s) {
  int32_t isum = 0, msum = 0;
  for (int64_t g = 0; g < QK / 16; ++g) {
    int32_t part = 0;
    for (int64_t i = 16 * g; i < 16 * g + 16; ++i) part += (SIGNED ? int32_t(int8_t(w.q[i])) : int32_t(w.q[i])) * int32_t(qa[i]);
    isum += int32_t(w.sc[g]) * part;
    msum += int32_t(w.mn[g]) * int32_t(bsum[g]);
  }
  s.acc += (w.d * da) * float(isum);
  if (!SIGNED) s.macc += (w.dmin * da) * float(msum);
}

inline float finish(const Sums& s) { return s.acc - s.macc; }
#endif

// One output row for every token: each block decoded once, then every token's part of it.
template <int64_t TYPE>
void row_dots(const uint8_t* row, int64_t K, const Acts& a, int64_t N, Block& w, Sums* sums) {
  constexpr int64_t QK = block_layout(TYPE).qk, BYTES = block_layout(TYPE).bytes;
  const int64_t nb = K / QK, ng = K / 16;
  std::fill(sums, sums + N, Sums());
  for (int64_t b = 0; b < nb; ++b) {
    w.decode(TYPE, row + b * BYTES, QK, true);
    for (int64_t t = 0; t < N; ++t)
      block_dot<QK, TYPE == Q8_0, TYPE == Q6_K>(w, &a.qa[t * K + b * QK], a.da[t * nb + b],
                                                &a.bsum[t * ng + b * QK / 16], sums[t]);
  }
}

#if defined(__AVX2__)
// Tokens per tile of the register-tiled loop: a tile's activations (TILE x K int8, 96 KB at the
// 1.5B's 1,536 inputs) stay in L2 while a thread's rows pass over them, where all of a long
// prompt's (512 x 1,536) would stream from L3 for every row, with every token's running sums.
constexpr int64_t TILE = 64;

// R output rows for tokens t0..t1 (at most TILE): each block of the R rows decoded once, then
// tile_dot over the tokens 4 at a time (the rest 3, 2 or 1). sums: [R][TILE].
template <int64_t TYPE, int R>
void tile_rows(const uint8_t* const* rows, int64_t K, const Acts& a, int64_t t0, int64_t t1, Block* w, Sums* sums) {
  constexpr int64_t QK = block_layout(TYPE).qk, BYTES = block_layout(TYPE).bytes;
  constexpr bool SIGNED = TYPE == Q8_0, PER16 = TYPE == Q6_K;
  const int64_t nb = K / QK, ng = K / 16;
  for (int r = 0; r < R; ++r) std::fill(sums + r * TILE, sums + r * TILE + (t1 - t0), Sums());
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) w[r].decode(TYPE, rows[r] + b * BYTES, QK, true);
    auto group = [&](auto tokens, int64_t t) {
      constexpr int T = decltype(tokens)::value;
      const int8_t* qa[T];
      float da[T];
      const int16_t* bsum[T];
      Sums* s[R];
      for (int j = 0; j < T; ++j) {
        qa[j] = &a.qa[(t + j) * K + b * QK];
        da[j] = a.da[(t + j) * nb + b];
        bsum[j] = &a.bsum[(t + j) * ng + b * QK / 16];
      }
      for (int r = 0; r < R; ++r) s[r] = sums + r * TILE + (t - t0);
      tile_dot<QK, SIGNED, PER16, R, T>(w, qa, da, bsum, s);
    };
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) group(std::integral_constant<int, 4>(), t);
    switch (t1 - t) {
      case 3: group(std::integral_constant<int, 3>(), t); break;
      case 2: group(std::integral_constant<int, 2>(), t); break;
      case 1: group(std::integral_constant<int, 1>(), t); break;
    }
  }
}

using TileRows = void (*)(const uint8_t* const*, int64_t, const Acts&, int64_t, int64_t, Block*, Sums*);

template <int R>
TileRows tile_rows_for(int64_t type) {
  switch (type) {
    case Q4_0: return tile_rows<Q4_0, R>;
    case Q4_1: return tile_rows<Q4_1, R>;
    case Q5_0: return tile_rows<Q5_0, R>;
    case Q5_1: return tile_rows<Q5_1, R>;
    case Q8_0: return tile_rows<Q8_0, R>;
    case Q4_K: return tile_rows<Q4_K, R>;
    case Q5_K: return tile_rows<Q5_K, R>;
    default: return tile_rows<Q6_K, R>;
  }
}
#endif

}  // namespace

// One block decoded into the common shape (decode_block, the scalar definition): for gguf_packed_rows.cpp.
float gguf_decode_block(int64_t type, const uint8_t* p, uint8_t* q, int16_t* sc, int16_t* mn) {
  return decode_block(type, p, q, sc, mn).d;
}

// A decoded block's qk values as float32 (q, sc / mn per 16, d, dmin as decode_block gives them):
// ggml's dequantization, bit for bit. Shared with gguf_packed_rows.cpp's gguf_packed_dequant.
void gguf_dequant_values(int64_t type, int64_t qk, const uint8_t* q, const int16_t* sc, const int16_t* mn, float d,
                         float dmin, float* o) {
  const int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0;
  for (int64_t i = 0; i < qk; ++i) {
    const float ds = d * float(sc[i / 16]);
    if (type == Q8_0)
      o[i] = ds * float(int8_t(q[i]));
    else if (offset)  // d * (q - offset): the order ggml's reference uses (the same bits)
      o[i] = ds * float(int(q[i]) - offset);
    else
      o[i] = ds * float(q[i]) - dmin * float(mn[i / 16]);
  }
}

// x [..., K] float32; parts: uint8 [rows_i, K / qk_i * bytes_i] of block types types[i]; the
// output [..., sum rows_i] holds the parts' rows in order (+ bias [sum rows_i] when given).
torch::Tensor gguf_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                        torch::Tensor bias) {
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "gguf_rows: one type per part");
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K;
  std::vector<int64_t> first{0};
  std::vector<Layout> layouts;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Layout L = layout_of(types[i]);
    TORCH_CHECK(K % L.qk == 0, "gguf_rows: ", K, " inputs is not a whole number of blocks of ", L.qk);
    TORCH_CHECK(parts[i].dtype() == torch::kUInt8 && parts[i].is_contiguous() && parts[i].dim() == 2 &&
                    parts[i].size(1) == K / L.qk * L.bytes,
                "gguf_rows: part ", i, " is not [rows, ", K / L.qk * L.bytes, "] contiguous uint8");
    layouts.push_back(L);
    first.push_back(first.back() + parts[i].size(0));
  }
  const int64_t M = first.back();
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || bias.numel() == M, "gguf_rows: bias has ", bias.numel(), " values, expected ", M);
  const float* bp = bias.defined() && bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  Acts a32, a256;
  for (const Layout& L : layouts) {
    Acts& a = L.qk == 32 ? a32 : a256;
    if (a.qk == 0) a = quantize_acts(x.data_ptr<float>(), N, K, L.qk);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = M;
  auto out = torch::empty(sizes, x.options());
  float* y = out.data_ptr<float>();
#if defined(__AVX2__)
  // Rows in pairs of one part, tokens in tiles (tile_rows): every (row, token) the same bits as
  // the one-row-at-a-time loop this replaced (checked on the real files' blocks of every type).
  // The 1.5B's MLP and attention matrices, 512 tokens, 2 threads, this AVX2 Zen 3: 657 -> 576 ms
  // (one row for all tokens) and a 512-token prefill 35-37 -> 44-46 tok/s; the packed kernel,
  // which gguf linears take where the build has AVX2, is twice as fast again.
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    Block w[2];
    std::vector<Sums> sums(2 * TILE);
    for (int64_t t0 = 0; t0 < N; t0 += TILE) {
      const int64_t t1 = std::min(N, t0 + TILE);
      for (int64_t r = r0; r < r1;) {
        const size_t i = std::upper_bound(first.begin(), first.end(), r) - first.begin() - 1;
        const int R = r + 1 < r1 && r + 1 < first[i + 1] ? 2 : 1;
        const uint8_t* rows[2];
        for (int j = 0; j < R; ++j) rows[j] = parts[i].data_ptr<uint8_t>() + (r + j - first[i]) * parts[i].size(1);
        const Acts& a = layouts[i].qk == 32 ? a32 : a256;
        (R == 2 ? tile_rows_for<2>(types[i]) : tile_rows_for<1>(types[i]))(rows, K, a, t0, t1, w, sums.data());
        for (int j = 0; j < R; ++j)
          for (int64_t t = t0; t < t1; ++t) {
            const float v = finish(sums[j * TILE + t - t0]);
            y[t * M + r + j] = bp ? v + bp[r + j] : v;
          }
        r += R;
      }
    }
  });
#else
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    Block w;
    std::vector<Sums> sums(N);
    for (int64_t r = r0; r < r1; ++r) {
      const size_t i = std::upper_bound(first.begin(), first.end(), r) - first.begin() - 1;
      const Layout L = layouts[i];
      const uint8_t* src = parts[i].data_ptr<uint8_t>() + (r - first[i]) * parts[i].size(1);
      const Acts& a = L.qk == 32 ? a32 : a256;
      switch (types[i]) {
        case Q4_0: row_dots<Q4_0>(src, K, a, N, w, sums.data()); break;
        case Q4_1: row_dots<Q4_1>(src, K, a, N, w, sums.data()); break;
        case Q5_0: row_dots<Q5_0>(src, K, a, N, w, sums.data()); break;
        case Q5_1: row_dots<Q5_1>(src, K, a, N, w, sums.data()); break;
        case Q8_0: row_dots<Q8_0>(src, K, a, N, w, sums.data()); break;
        case Q4_K: row_dots<Q4_K>(src, K, a, N, w, sums.data()); break;
        case Q5_K: row_dots<Q5_K>(src, K, a, N, w, sums.data()); break;
        default: row_dots<Q6_K>(src, K, a, N, w, sums.data()); break;
      }
      for (int64_t t = 0; t < N; ++t) {
        const float v = finish(sums[t]);
        y[t * M + r] = bp ? v + bp[r] : v;
      }
    }
  });
#endif
  return out;
}

// w [rows, bytes] of block type `type`, ids [n] -> [n, K] float32: the values the kernel
// computes with, (d * sc) * q - (dmin * mn) per value (ggml's dequantization, exactly).
torch::Tensor gguf_dequant_rows(torch::Tensor w, int64_t type, torch::Tensor ids, int64_t K, bool vector) {
  const Layout L = layout_of(type);
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.size(1) == K / L.qk * L.bytes,
              "gguf_dequant_rows: w is not [rows, ", K / L.qk * L.bytes, "] contiguous uint8");
  const auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), rows = w.size(0);
  auto out = torch::empty({n, K}, torch::kFloat32);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < rows, "gguf_dequant_rows: id ", ip[j], " out of range");
  const uint8_t* base = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
    Block blk;
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t b = 0; b < K / L.qk; ++b) {
        blk.decode(type, base + ip[j] * w.size(1) + b * L.bytes, L.qk, vector);
        gguf_dequant_values(type, L.qk, blk.q, blk.sc, blk.mn, blk.d, blk.dmin, op + j * K + b * L.qk);
      }
    }
  });
  return out;
}

void bind_gguf_rows(pybind11::module& m) {
  m.def("gguf_rows", &gguf_rows, "linear over a GGUF file's quantized blocks, batch-invariant", ReleaseGil());
  m.def("gguf_dequant_rows", &gguf_dequant_rows, "rows of a GGUF quantized tensor as the kernel computes with them",
        pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("ids"), pybind11::arg("K"), pybind11::arg("vector") = true);
}
