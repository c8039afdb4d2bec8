// GGUF K-quant blocks rearranged 16 rows at a time so that a vector holds 16 outputs: the
// same bits as the file (a permutation of its bytes, reversible), computed with one VNNI
// instruction per 16 outputs x 4 inputs, as int4_rows.cpp does for forerun's own int4.
//
// gguf_rows.cpp reads the file's row-major blocks: every output row then needs its own
// horizontal dot product per token, about six instructions per 32 values per token. Here a
// tile of 16 rows stores, per block of 256 inputs:
//   values   32 vectors of 64 bytes; vector v, byte 4*l + j: the low nibble is value 8v + j of
//            row l, the high nibble value 8v + 4 + j (a 4-bit value, or the low 4 bits of a
//            6-bit one)
//   Q4_K     sc int8 [8][16] (sub-block s of 32 values, row l), mn int8 [4][16][2] (the
//            mins of sub-blocks 2p and 2p + 1 side by side), d f16 [16], dmin f16 [16]
//            2048 + 128 + 128 + 64 = 2368 bytes = 16 x 148 (the file: 16 x 144)
//   Q6_K     hi int8 [16][64] (sub-block s of 16 values: byte 4*l + j holds the top two bits
//            of values 16s + j, 16s + 4 + j, 16s + 8 + j, 16s + 12 + j of row l, lowest
//            first), sc int8 [16][16], d f16 [16]
//            2048 + 1024 + 256 + 32 = 3360 bytes = 16 x 210 (the file's size)
// Numerics, per row, token and block, with qa / da / bsum the activations as gguf_rows.cpp
// quantizes them (int8 per 256 values, scale da, sums per 16):
//   Q4_K  I = sum_s sc_s * (sum_{i in s} q_i qa_i),  Mn = sum_s mn_s * bsum32_s    (int32, exact)
//         acc = fma(float(I), d * da, acc);  acc = fma(-float(Mn), dmin * da, acc)
//   Q6_K  I = sum_s sc_s * (sum_{i in s} q_i qa_i - 32 * bsum_s)                  (int32, exact)
//         acc = fma(float(I), d * da, acc)
// blocks in order, then y = acc (+ bias). The AVX512-VNNI path and the scalar one run these
// operations in this order, so they give the same bits; every token gets its own accumulator
// whatever its batch-mates (batch invariance, as in gguf_rows.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_GGUF_VNNI 1
#endif

void gguf_quantize_acts(const float* x, int64_t N, int64_t K, int64_t qk, int8_t* qa, float* da,
                        int16_t* bsum);                                                            // gguf_rows.cpp
float gguf_decode_block(int64_t type, const uint8_t* p, uint8_t* q, int16_t* sc, int16_t* mn);  // gguf_rows.cpp

namespace {

constexpr int64_t Q4_K = 12, Q6_K = 14, LANES = 16, QK = 256;
constexpr int64_t MAX_TB = 8;  // tokens per pass over a tile's weights (8 vs 4: 8 tokens 23.3 -> 21.4 ms below)
// Ask for the weights 20 KB ahead into L2, as int4_rows.cpp does: 26 Q4_K / Q6_K matrices of the
// 1.5B's MLP shapes (0.37 GB, more than the caches), median of 5 interleaved rounds, this 2-core
// AVX512-VNNI EPYC: 1 token 21.3 -> 14.4 ms (17 -> 26 GB/s), 4 tokens 33.7 -> 14.3 ms, against
// 6 blocks ahead into L1; 40 KB ahead changes nothing.
constexpr int64_t PREFETCH_BYTES = 20480;

struct Packed {
  int64_t src_bytes, bytes;  // per row-block in the file; per 16-row tile-block here
  int64_t sc, mn, hi, d, dmin;  // offsets of the fields (-1: absent)
};

Packed packed_of(int64_t type) {
  if (type == Q4_K) return {144, 2368, 2048, 2176, -1, 2304, 2336};
  if (type == Q6_K) return {210, 3360, 3072, -1, 2048, 3328, -1};
  TORCH_CHECK(false, "GGUF block type ", type, " has no packed kernel (Q4_K and Q6_K do)");
}

// The fields of one tile-block as runs of 16 lanes x `width` bytes: what moves with a row.
std::vector<std::pair<int64_t, int64_t>> lane_runs(int64_t type) {  // (offset, width)
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t v = 0; v < 32; ++v) runs.push_back({64 * v, 4});
  const Packed P = packed_of(type);
  if (type == Q4_K) {
    for (int64_t s = 0; s < 8; ++s) runs.push_back({P.sc + 16 * s, 1});
    for (int64_t p = 0; p < 4; ++p) runs.push_back({P.mn + 32 * p, 2});
    runs.push_back({P.d, 2});
    runs.push_back({P.dmin, 2});
  } else {
    for (int64_t s = 0; s < 16; ++s) runs.push_back({P.hi + 64 * s, 4});
    for (int64_t s = 0; s < 16; ++s) runs.push_back({P.sc + 16 * s, 1});
    runs.push_back({P.d, 2});
  }
  return runs;
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One row's block (the file's bytes `src`) into lane l of a tile-block.
void pack_lane(int64_t type, const uint8_t* src, int64_t l, uint8_t* dst) {
  uint8_t q[256];
  int16_t sc[16], mn[16];
  gguf_decode_block(type, src, q, sc, mn);
  for (int v = 0; v < 32; ++v)
    for (int j = 0; j < 4; ++j) dst[64 * v + 4 * l + j] = (q[8 * v + j] & 15) | ((q[8 * v + 4 + j] & 15) << 4);
  const Packed P = packed_of(type);
  if (type == Q4_K) {
    for (int s = 0; s < 8; ++s) dst[P.sc + 16 * s + l] = static_cast<uint8_t>(sc[2 * s]);
    for (int p = 0; p < 4; ++p) {
      dst[P.mn + 32 * p + 2 * l] = static_cast<uint8_t>(mn[4 * p]);
      dst[P.mn + 32 * p + 2 * l + 1] = static_cast<uint8_t>(mn[4 * p + 2]);
    }
    std::memcpy(dst + P.d + 2 * l, src, 2);
    std::memcpy(dst + P.dmin + 2 * l, src + 2, 2);
  } else {
    for (int s = 0; s < 16; ++s) {
      for (int j = 0; j < 4; ++j) {
        uint8_t h = 0;
        for (int o = 0; o < 4; ++o) h |= ((q[16 * s + 4 * o + j] >> 4) & 3) << (2 * o);
        dst[P.hi + 64 * s + 4 * l + j] = h;
      }
      dst[P.sc + 16 * s + l] = static_cast<uint8_t>(sc[s]);
    }
    std::memcpy(dst + P.d + 2 * l, src + 208, 2);
  }
}

// Lane l of a tile-block back into values q[256], per-16 sc / mn and {d, dmin} (for gguf_packed_dequant).
void unpack_lane(int64_t type, const uint8_t* blk, int64_t l, uint8_t* q, int16_t* sc, int16_t* mn, float* d, float* dmin) {
  for (int v = 0; v < 32; ++v)
    for (int j = 0; j < 4; ++j) {
      const uint8_t b = blk[64 * v + 4 * l + j];
      q[8 * v + j] = b & 15;
      q[8 * v + 4 + j] = b >> 4;
    }
  const Packed P = packed_of(type);
  *d = f16(blk + P.d + 2 * l);
  if (type == Q4_K) {
    for (int s = 0; s < 16; ++s) sc[s] = static_cast<int8_t>(blk[P.sc + 16 * (s / 2) + l]);
    for (int s = 0; s < 16; ++s) mn[s] = static_cast<int8_t>(blk[P.mn + 32 * (s / 4) + 2 * l + (s / 2) % 2]);
    *dmin = f16(blk + P.dmin + 2 * l);
  } else {
    for (int s = 0; s < 16; ++s) {
      for (int o = 0; o < 4; ++o)
        for (int j = 0; j < 4; ++j) q[16 * s + 4 * o + j] |= ((blk[P.hi + 64 * s + 4 * l + j] >> (2 * o)) & 3) << 4;
      sc[s] = static_cast<int8_t>(blk[P.sc + 16 * s + l]);
      mn[s] = static_cast<int16_t>(32 * sc[s]);
    }
    *dmin = *d;
  }
}

// Activations as the packed kernels read them: qa [N, K], da [N, K/256], and per token
// Q4_K: the sums of 32 values in pairs as int16 x 2 (bp [N, K/64]); Q6_K: 32 x the sums of
// 16 values (b32 [N, K/16]).
struct Acts {
  std::vector<int8_t> qa;
  std::vector<float> da;
  std::vector<int32_t> bp, b32;
};

Acts quantize(const float* x, int64_t N, int64_t K) {
  Acts a;
  a.qa.resize(N * K);
  a.da.resize(N * (K / QK));
  std::vector<int16_t> bsum(N * (K / 16));
  gguf_quantize_acts(x, N, K, QK, a.qa.data(), a.da.data(), bsum.data());
  a.bp.resize(N * (K / 64));
  a.b32.resize(N * (K / 16));
  for (int64_t i = 0; i < N * (K / 16); ++i) a.b32[i] = 32 * int32_t(bsum[i]);
  for (int64_t i = 0; i < N * (K / 64); ++i) {
    const int32_t s0 = int32_t(bsum[4 * i]) + bsum[4 * i + 1], s1 = int32_t(bsum[4 * i + 2]) + bsum[4 * i + 3];
    a.bp[i] = int32_t((uint32_t(uint16_t(int16_t(s1))) << 16) | uint16_t(int16_t(s0)));
  }
  return a;
}

// One tile (16 rows) for TB tokens: out[t * 16 + l]. qa, da, bp / b32 point at token 0.
template <int64_t TYPE, int TB>
void tile_dots(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* bp,
               const int32_t* b32, float* out) {
  constexpr Packed P = TYPE == Q4_K ? Packed{144, 2368, 2048, 2176, -1, 2304, 2336} : Packed{210, 3360, 3072, -1, 2048, 3328, -1};
#ifdef FORERUN_GGUF_VNNI
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * P.bytes;
    for (int64_t c = 0; c < P.bytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES + c), _MM_HINT_T1);
    __m512i isum[TB];
    for (int t = 0; t < TB; ++t) isum[t] = _mm512_setzero_si512();
    constexpr int SUBS = TYPE == Q4_K ? 8 : 16, VECS = 32 / SUBS;  // nibble vectors per sub-block
    for (int s = 0; s < SUBS; ++s) {
      const __m512i scv = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + P.sc + 16 * s)));
      __m512i hv = _mm512_setzero_si512();
      if constexpr (TYPE == Q6_K) hv = _mm512_loadu_si512(blk + P.hi + 64 * s);
      __m512i dot[TB];
      for (int t = 0; t < TB; ++t) dot[t] = _mm512_setzero_si512();
      for (int v = 0; v < VECS; ++v) {
        const __m512i x = _mm512_loadu_si512(blk + 64 * (VECS * s + v));
        __m512i lo = _mm512_and_si512(x, m4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
        if constexpr (TYPE == Q6_K) {  // top bits of operands 2v (lo) and 2v + 1 (hi): bit pairs 4v and 4v + 2
          const __m512i h0 = v == 0 ? _mm512_slli_epi16(hv, 4) : hv;
          const __m512i h1 = v == 0 ? _mm512_slli_epi16(hv, 2) : _mm512_srli_epi16(hv, 2);
          lo = _mm512_or_si512(lo, _mm512_and_si512(h0, m30));
          hi = _mm512_or_si512(hi, _mm512_and_si512(h1, m30));
        }
        const int64_t k = b * QK + 8 * (VECS * s + v);
        for (int t = 0; t < TB; ++t) {
          int32_t a0, a1;
          std::memcpy(&a0, qa + t * K + k, 4);
          std::memcpy(&a1, qa + t * K + k + 4, 4);
          dot[t] = _mm512_dpbusd_epi32(dot[t], lo, _mm512_set1_epi32(a0));
          dot[t] = _mm512_dpbusd_epi32(dot[t], hi, _mm512_set1_epi32(a1));
        }
      }
      for (int t = 0; t < TB; ++t) {
        __m512i d = dot[t];
        if constexpr (TYPE == Q6_K) d = _mm512_sub_epi32(d, _mm512_set1_epi32(b32[t * (K / 16) + b * 16 + s]));
        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(d, scv));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.d)));
    if constexpr (TYPE == Q4_K) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.dmin)));
      __m512i msum[TB];
      for (int t = 0; t < TB; ++t) msum[t] = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i mn = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.mn + 32 * p)));
        for (int t = 0; t < TB; ++t) msum[t] = _mm512_dpwssd_epi32(msum[t], mn, _mm512_set1_epi32(bp[t * (K / 64) + 4 * b + p]));
      }
      for (int t = 0; t < TB; ++t) {
        const __m512 dd = _mm512_set1_ps(da[t * nb + b]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dv, dd), acc[t]);
        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[t]), _mm512_mul_ps(mv, dd), acc[t]);
      }
    } else {
      for (int t = 0; t < TB; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dv, _mm512_set1_ps(da[t * nb + b])), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + LANES * t, acc[t]);
#else
  for (int t = 0; t < TB; ++t)
    for (int64_t l = 0; l < LANES; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * P.bytes;
        uint8_t q[256];
        int16_t sc[16], mn[16];
        float d, dmin;
        unpack_lane(TYPE, blk, l, q, sc, mn, &d, &dmin);
        const int8_t* x = qa + t * K + b * QK;
        int32_t isum = 0, msum = 0;
        const int sub = TYPE == Q4_K ? 32 : 16;
        for (int s = 0; s < QK / sub; ++s) {
          int32_t dot = 0;
          for (int i = sub * s; i < sub * (s + 1); ++i) dot += int32_t(q[i]) * int32_t(x[i]);
          if (TYPE == Q6_K) dot -= b32[t * (K / 16) + b * 16 + s];
          isum += dot * int32_t(sc[sub / 16 * s]);
        }
        const float dd = da[t * nb + b];
        acc = std::fma(float(isum), d * dd, acc);
        if (TYPE == Q4_K) {
          for (int p = 0; p < 4; ++p) {
            const int32_t pair = bp[t * (K / 64) + 4 * b + p];
            msum += int32_t(mn[4 * p]) * int32_t(int16_t(pair & 0xFFFF)) + int32_t(mn[4 * p + 2]) * int32_t(int16_t(uint32_t(pair) >> 16));
          }
          acc = std::fma(-float(msum), dmin * dd, acc);
        }
      }
      out[LANES * t + l] = acc;
    }
#endif
}

template <int64_t TYPE>
void tile_all_tokens(const uint8_t* w, int64_t nb, const Acts& a, int64_t N, int64_t K, float* out) {
  for (int64_t t0 = 0; t0 < N; t0 += MAX_TB) {
    const int64_t tb = std::min(MAX_TB, N - t0);
    const int8_t* qa = a.qa.data() + t0 * K;
    const float* da = a.da.data() + t0 * nb;
    const int32_t *bp = a.bp.data() + t0 * (K / 64), *b32 = a.b32.data() + t0 * (K / 16);
    float* o = out + LANES * t0;
    switch (tb) {
      case 1: tile_dots<TYPE, 1>(w, nb, qa, K, da, bp, b32, o); break;
      case 2: tile_dots<TYPE, 2>(w, nb, qa, K, da, bp, b32, o); break;
      case 3: tile_dots<TYPE, 3>(w, nb, qa, K, da, bp, b32, o); break;
      case 4: tile_dots<TYPE, 4>(w, nb, qa, K, da, bp, b32, o); break;
      case 5: tile_dots<TYPE, 5>(w, nb, qa, K, da, bp, b32, o); break;
      case 6: tile_dots<TYPE, 6>(w, nb, qa, K, da, bp, b32, o); break;
      case 7: tile_dots<TYPE, 7>(w, nb, qa, K, da, bp, b32, o); break;
      default: tile_dots<TYPE, 8>(w, nb, qa, K, da, bp, b32, o); break;
    }
  }
}

void check_part(const torch::Tensor& p, int64_t type, int64_t rows, int64_t K, const char* who) {
  const Packed P = packed_of(type);
  TORCH_CHECK(K % QK == 0, who, ": ", K, " inputs is not a whole number of blocks of ", QK);
  TORCH_CHECK(p.dtype() == torch::kUInt8 && p.is_contiguous() && p.dim() == 2 && p.size(0) * LANES >= rows &&
                  p.size(0) * LANES < rows + LANES && p.size(1) == K / QK * P.bytes,
              who, ": a packed part is not [ceil(rows / 16), ", K / QK * P.bytes, "] contiguous uint8");
}

}  // namespace

// w [rows, K / 256 * bytes] (the file's blocks) -> [ceil(rows / 16), K / 256 * tile-block bytes].
torch::Tensor gguf_pack(torch::Tensor w, int64_t type, int64_t K) {
  const Packed P = packed_of(type);
  TORCH_CHECK(K % QK == 0 && w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 &&
                  w.size(1) == K / QK * P.src_bytes,
              "gguf_pack: w is not [rows, ", K / QK * P.src_bytes, "] contiguous uint8");
  const int64_t rows = w.size(0), tiles = (rows + LANES - 1) / LANES, nb = K / QK;
  auto out = torch::zeros({tiles, nb * P.bytes}, torch::kUInt8);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t l = 0; l < LANES && i * LANES + l < rows; ++l)
        for (int64_t b = 0; b < nb; ++b)
          pack_lane(type, src + (i * LANES + l) * w.size(1) + b * P.src_bytes, l, dst + i * nb * P.bytes + b * P.bytes);
  });
  return out;
}

// Rows `ids` of a packed matrix, packed again (a reduced LM head): lanes moved byte for byte.
torch::Tensor gguf_packed_select(torch::Tensor w, int64_t type, torch::Tensor ids, int64_t K) {
  const Packed P = packed_of(type);
  const auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), nb = K / QK, tiles = (n + LANES - 1) / LANES;
  check_part(w, type, (w.size(0) - 1) * LANES + 1, K, "gguf_packed_select");
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < w.size(0) * LANES, "gguf_packed_select: id ", ip[j], " out of range");
  auto out = torch::zeros({tiles, nb * P.bytes}, torch::kUInt8);
  const auto runs = lane_runs(type);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t st = ip[j] / LANES, sl = ip[j] % LANES, dt = j / LANES, dl = j % LANES;
    for (int64_t b = 0; b < nb; ++b)
      for (const auto& [off, width] : runs)
        std::memcpy(dst + dt * nb * P.bytes + b * P.bytes + off + width * dl,
                    src + st * nb * P.bytes + b * P.bytes + off + width * sl, width);
  }
  return out;
}

// Rows `ids` of a packed matrix as float32 [n, K]: ggml's dequantization, bit for bit.
torch::Tensor gguf_packed_dequant(torch::Tensor w, int64_t type, torch::Tensor ids, int64_t K) {
  const Packed P = packed_of(type);
  check_part(w, type, (w.size(0) - 1) * LANES + 1, K, "gguf_packed_dequant");
  const auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel(), nb = K / QK;
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < w.size(0) * LANES, "gguf_packed_dequant: id ", ip[j], " out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  const uint8_t* base = w.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
    uint8_t q[256];
    int16_t sc[16], mn[16];
    float d, dmin;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t b = 0; b < nb; ++b) {
        unpack_lane(type, base + (ip[j] / LANES) * nb * P.bytes + b * P.bytes, ip[j] % LANES, q, sc, mn, &d, &dmin);
        float* o = op + j * K + b * QK;
        for (int i = 0; i < QK; ++i) {
          const float ds = d * float(sc[i / 16]);
          o[i] = type == Q6_K ? ds * float(int(q[i]) - 32) : ds * float(q[i]) - dmin * float(mn[i / 16]);
        }
      }
  });
  return out;
}

// x [..., K] float32; parts [ceil(rows_i / 16), ...] packed of types[i] with rows[i] rows ->
// [..., sum rows_i] (+ bias [sum rows_i] when given), the parts' rows in order.
torch::Tensor gguf_packed_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                               std::vector<int64_t> rows, torch::Tensor bias) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size() && parts.size() == rows.size(),
              "gguf_packed_rows: one type and one row count per part");
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K, nb = K / QK;
  std::vector<int64_t> first{0}, tile_first{0};
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(parts[i], types[i], rows[i], K, "gguf_packed_rows");
    first.push_back(first.back() + rows[i]);
    tile_first.push_back(tile_first.back() + parts[i].size(0));
  }
  const int64_t M = first.back();
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || bias.numel() == M, "gguf_packed_rows: bias has ", bias.numel(),
              " values, expected ", M);
  const float* bp = bias.defined() && bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  const Acts a = quantize(x.data_ptr<float>(), N, K);
  auto sizes = x.sizes().vec();
  sizes.back() = M;
  auto out = torch::empty(sizes, x.options());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, tile_first.back(), 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> acc(N * LANES);
    for (int64_t u = u0; u < u1; ++u) {
      const size_t i = std::upper_bound(tile_first.begin(), tile_first.end(), u) - tile_first.begin() - 1;
      const int64_t tile = u - tile_first[i];
      const uint8_t* w = parts[i].data_ptr<uint8_t>() + tile * parts[i].size(1);
      if (types[i] == Q4_K)
        tile_all_tokens<Q4_K>(w, nb, a, N, K, acc.data());
      else
        tile_all_tokens<Q6_K>(w, nb, a, N, K, acc.data());
      const int64_t r0 = first[i] + tile * LANES, n = std::min(LANES, rows[i] - tile * LANES);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t l = 0; l < n; ++l) y[t * M + r0 + l] = bp ? acc[t * LANES + l] + bp[r0 + l] : acc[t * LANES + l];
    }
  });
  return out;
}

bool gguf_packed_vnni() {
#ifdef FORERUN_GGUF_VNNI
  return true;
#else
  return false;
#endif
}

void bind_gguf_packed_rows(pybind11::module& m) {
  m.def("gguf_pack", &gguf_pack, "GGUF K-quant rows rearranged 16 rows per tile (the same bits)");
  m.def("gguf_packed_select", &gguf_packed_select, "rows of a packed GGUF matrix, packed");
  m.def("gguf_packed_dequant", &gguf_packed_dequant, "rows of a packed GGUF matrix as float32 (ggml's values)");
  m.def("gguf_packed_rows", &gguf_packed_rows, "linear over packed GGUF K-quant tiles, batch-invariant");
  m.def("gguf_packed_vnni", &gguf_packed_vnni, "whether the packed GGUF kernel was compiled with AVX512-VNNI");
}
