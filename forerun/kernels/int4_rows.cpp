// int4 linear: 4-bit weights in groups of 64 inputs (a scale and a minimum per group, as
// GGUF's Q4_1 / Q4_K sub-blocks have), int8 activations with one scale per group of 64 inputs
// too (as llama.cpp's Q8 activation blocks: a few large channels no longer flatten the rest
// of the token, as one scale per token did), int32 dot products per group.
//
// Numerics, per token row x (after the folded RMSNorm, if any) and output j (g: a group of 64
// inputs; K padded with zeros to Kp):
//   w[j, k] = d[j, g] * u[j, k] + m[j, g]      u in 0..15, d and m float16
//   amax_g  = max_{k in g} |x[k]|;  a[k] = nearbyint(x[k] * (127 / amax_g)) in [-127, 127]
//   s_g     = amax_g / 127  (a = 0 and s_g = 0 for an all-zero group);  sa[g] = sum_{k in g} a[k]
//   S_j     = sum over g, in order, of  fma(fma(float(dp[j,g]), d[j,g], m[j,g] * sa[g]), s_g, S)
//             with dp[j,g] = sum_{k in g} a[k] u[j,k]  (exact int32)
//   y_j     = S_j + bias[j]
// so S_j = sum_g s_g sum_{k in g} a[k] w[j,k]. Every token runs this same instruction sequence
// whatever its batch-mates, for any number of rows: one kernel serves decoding, verification
// and prefill, and the int4 model is batch-invariant like the int8 one.
#include "kernels.h"
#include "paired16.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include <atomic>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_VNNI4 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FORERUN_INT4_AVX2 1
#endif

void quantize_groups_rows(const float* xp, int64_t N, int64_t K, int64_t Kp, const float* nw, double eps, int8_t* a,
                          float* sa, float* sg);  // int8_rows.cpp

// Packed weights (quant4.pack_int4): [Mp/16, G, 8, 64] bytes. Block b holds 16 outputs; in
// group g, byte 4*l + j of vector i holds u[out l, k = 64g + 8i + j] in its low nibble and
// u[out l, k = 64g + 8i + 4 + j] in its high nibble: each nibble plane is one VNNI operand
// (16 outputs x 4 consecutive inputs). d, m: [Mp/16, G, 16] float16.
constexpr int64_t OUT_BLOCK = 16, GROUP = 64, VECS = 8, MAX_TOKENS = 8;
constexpr int CHUNK_BLOCKS = 2;
// Ask for the weights 40 groups (20 KB) ahead into L2, so streaming overlaps the arithmetic:
// with many tokens the dots are slow enough that the hardware prefetcher falls behind DRAM
// (the 1.5B's linears, 8 tokens: ~56 ms without, ~40 ms with), and even one token gains
// (the 0.5B's 24 layers of linears, interleaved runs: 10.2 -> 9.1 ms at 8 KB ahead; 20 KB
// ahead takes another 5-7% off one token and changes nothing at 2-6: two builds A/B in one process).
constexpr int64_t PREFETCH_GROUPS = 40;

// The A/B switch for scripts (set_int4_paired): false sends 3-8 tokens through avx2_dots a half
// at a time, as before avx2_paired (AVX2 builds only; the bits are the same either way).
static std::atomic<bool> int4_paired{true};

bool set_int4_paired(bool on) { return int4_paired.exchange(on); }

static inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// The definition, in plain C++ (the path of a build without SIMD, and reference=True's on any
// build): out[(b * TB + t) * 16 + l] = S for output block b of the chunk, token t, lane l.
static void scalar_dots(int TB, int CB, const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                        const uint8_t* w, const uint16_t* d, const uint16_t* m, float* out) {
  const int64_t block_bytes = G * VECS * 64;
  for (int b = 0; b < CB; ++b)
    for (int t = 0; t < TB; ++t)
      for (int l = 0; l < OUT_BLOCK; ++l) {
        const uint8_t* wb = w + b * block_bytes;
        float s = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t dp = 0;
          for (int i = 0; i < VECS; ++i)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = wb[(g * VECS + i) * 64 + 4 * l + j];
              dp += int32_t(a[t * Kp + g * GROUP + 8 * i + j]) * int32_t(byte & 0x0F);
              dp += int32_t(a[t * Kp + g * GROUP + 8 * i + 4 + j]) * int32_t(byte >> 4);
            }
          const float ms = half_to_float(m[(b * G + g) * OUT_BLOCK + l]) * sa[t * G + g];
          const float gj = std::fma(static_cast<float>(dp), half_to_float(d[(b * G + g) * OUT_BLOCK + l]), ms);
          s = std::fma(gj, sg[t * G + g], s);
        }
        out[(b * TB + t) * OUT_BLOCK + l] = s;
      }
}

#ifdef FORERUN_VNNI4
// out[(b * TB + t) * 16 + l] = S for output block b of the chunk (CHUNK_BLOCKS blocks of 16
// outputs), token t (of TB) and lane l. Each 64-byte weight load serves every token of the
// tile; each token's 4 activation bytes are broadcast once for the CB blocks (CB = 2 for 1-2
// tokens; for more, one block at a time keeps TB int and TB float accumulators in registers).
// VNNI multiplies unsigned by signed bytes: the weights' nibbles are the unsigned side,
// the activations a (in [-127, 127]) the signed one.
// Few tokens (SPLIT): low nibbles as v & 0x0F, high ones as v & 0xF0 = 16u into a second
// accumulator, joined as lo + (hi >> 4) (one op less per load, twice the chains); many
// tokens: (v >> 4) & 0x0F into the same accumulator (registers are short). Both give the
// same exact int32 dot product, so the tile size never changes a bit.
template <int TB, bool SPLIT, int CB>
static inline void chunk_dots(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                              const uint8_t* w, const uint16_t* d, const uint16_t* m, float* out) {
  const int64_t block_bytes = G * VECS * 64;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 facc[CB][TB];
  for (int b = 0; b < CB; ++b)
    for (int t = 0; t < TB; ++t) facc[b][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[CB][TB], acc2[CB][SPLIT ? TB : 1];
    for (int b = 0; b < CB; ++b)
      for (int t = 0; t < TB; ++t) {
        acc[b][t] = _mm512_setzero_si512();
        if constexpr (SPLIT) acc2[b][t] = _mm512_setzero_si512();
      }
    for (int b = 0; b < CB; ++b)  // blocks are contiguous: past a block's end this reads the next one's
      for (int i = 0; i < VECS; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + ((g + PREFETCH_GROUPS) * VECS + i) * 64), _MM_HINT_T1);
    for (int i = 0; i < VECS; ++i) {
      __m512i lo[CB], hi[CB];
      for (int b = 0; b < CB; ++b) {
        const __m512i v = _mm512_loadu_si512(w + b * block_bytes + (g * VECS + i) * 64);
        lo[b] = _mm512_and_si512(v, low);
        hi[b] = SPLIT ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int t = 0; t < TB; ++t) {
        int32_t a0, a1;
        std::memcpy(&a0, a + t * Kp + g * GROUP + 8 * i, 4);
        std::memcpy(&a1, a + t * Kp + g * GROUP + 8 * i + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(a0), x1 = _mm512_set1_epi32(a1);
        for (int b = 0; b < CB; ++b) {
          acc[b][t] = _mm512_dpbusd_epi32(acc[b][t], lo[b], x0);
          if constexpr (SPLIT) acc2[b][t] = _mm512_dpbusd_epi32(acc2[b][t], hi[b], x1);
          else acc[b][t] = _mm512_dpbusd_epi32(acc[b][t], hi[b], x1);
        }
      }
    }
    for (int b = 0; b < CB; ++b) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (b * G + g) * OUT_BLOCK)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + (b * G + g) * OUT_BLOCK)));
      for (int t = 0; t < TB; ++t) {
        __m512i dp = acc[b][t];
        if constexpr (SPLIT) dp = _mm512_add_epi32(dp, _mm512_srai_epi32(acc2[b][t], 4));  // exact: 16 | acc2
        const __m512 ms = _mm512_mul_ps(mv, _mm512_set1_ps(sa[t * G + g]));
        const __m512 gj = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), dv, ms);
        facc[b][t] = _mm512_fmadd_ps(gj, _mm512_set1_ps(sg[t * G + g]), facc[b][t]);
      }
    }
  }
  for (int b = 0; b < CB; ++b)
    for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + (b * TB + t) * OUT_BLOCK, facc[b][t]);
}

// Many tokens: one output block at a time (TB accumulators + TB float sums stay in registers).
template <int TB>
static inline void one_by_one(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                              const uint8_t* w, const uint16_t* d, const uint16_t* m, float* out) {
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    chunk_dots<TB, false, 1>(a, Kp, sa, sg, G, w + b * G * VECS * 64, d + b * G * OUT_BLOCK, m + b * G * OUT_BLOCK,
                             out + b * TB * OUT_BLOCK);
}
#endif

#ifdef FORERUN_INT4_AVX2
// AVX2 (with FMA and F16C): the same operations 8 outputs at a time, half of each 64-byte
// vector. vpdpbusd's exact int32 sums come from maddubs + madd: maddubs multiplies a nibble
// (0..15) by an activation byte (-127..127) and adds pairs, |pair| <= 3810, so it never
// saturates, nor does the low and high planes' int16 sum (<= 7620); madd with ones adds pairs
// of those into int32 lanes: the 8 products a VNNI lane sums, exactly. The float operations are
// the VNNI path's, lane for lane, so the bits are the definition's (tests/test_int4.py compares
// them with torch.equal). TB tokens x H halves of one output block, TB * H <= 4 (int and float
// accumulators for each, and the nibble planes, fit AVX2's 16 registers).
// The end of group g on 8 rows of a block (their d, m at d + at, m + at) for TB tokens, token t's
// exact int32 sum at isum[t * stride]: facc[t] = fma(fma(float(sum), d, m * sa), sg, facc[t]), the
// VNNI path's float operations in its order. avx2_dots and avx2_paired both end a group here, so
// their bits cannot drift apart.
template <int TB>
__attribute__((always_inline)) static inline void group_end_avx2(const uint16_t* d, const uint16_t* m, int64_t at,
                                                                 const float* sa, const float* sg, int64_t G, int64_t g,
                                                                 const __m256i* isum, int stride, __m256* facc) {
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + at)));
  const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + at)));
  for (int t = 0; t < TB; ++t) {
    const __m256 ms = _mm256_mul_ps(mv, _mm256_set1_ps(sa[t * G + g]));
    const __m256 gj = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t * stride]), dv, ms);
    facc[t] = _mm256_fmadd_ps(gj, _mm256_set1_ps(sg[t * G + g]), facc[t]);
  }
}

template <int TB, int H>
static inline void avx2_dots(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                             const uint8_t* w, const uint16_t* d, const uint16_t* m, int h0, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 facc[H][TB];
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < TB; ++t) facc[h][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[H][TB];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < TB; ++t) acc[h][t] = _mm256_setzero_si256();
    if (h0 == 0)  // one pass a block asks for its weights ahead (past its end: the next block's)
      for (int i = 0; i < VECS; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + ((g + PREFETCH_GROUPS) * VECS + i) * 64), _MM_HINT_T1);
    for (int i = 0; i < VECS; ++i) {
      __m256i lo[H], hi[H];
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * VECS + i) * 64 + (h0 + h) * 32));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int t = 0; t < TB; ++t) {
        int32_t a0, a1;
        std::memcpy(&a0, a + t * Kp + g * GROUP + 8 * i, 4);
        std::memcpy(&a1, a + t * Kp + g * GROUP + 8 * i + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(a0), x1 = _mm256_set1_epi32(a1);
        for (int h = 0; h < H; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1));
          acc[h][t] = _mm256_add_epi32(acc[h][t], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < H; ++h) group_end_avx2<TB>(d, m, g * OUT_BLOCK + (h0 + h) * 8, sa, sg, G, g, acc[h], 1, facc[h]);
  }
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + t * OUT_BLOCK + (h0 + h) * 8, facc[h][t]);
}

// 3 to 8 tokens x both halves of one output block: a group's 8 vectors in 4 passes of 2, whose
// unpacked nibbles (both halves: 8 registers) stay in registers while each token's step runs
// (paired16.h: 16 inputs, 4 maddubs a half summed in int16, at most 4 x 3810, then one madd by
// ones), its int32 sums kept in memory. One pass over a block's weights, and each broadcast
// serves both halves, where avx2_dots with a half at a time read and unpacked every vector twice
// and broadcast per half. The same exact int32 sums per group and the same float operations in
// the same order, so the same bits (tests/test_int4.py).
template <int TB>
static void avx2_paired(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                        const uint8_t* w, const uint16_t* d, const uint16_t* m, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) __m256i isum[TB][2];  // per token: rows 0-7, rows 8-15
  __m256 facc[2][TB];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) facc[h][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int t = 0; t < TB; ++t) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
    for (int i = 0; i < VECS; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(w + ((g + PREFETCH_GROUPS) * VECS + i) * 64), _MM_HINT_T1);
    for (int pass = 0; pass < VECS / 2; ++pass) {  // vectors 2 pass and 2 pass + 1: inputs 16 pass .. 16 pass + 15
      const uint8_t* x = w + (g * VECS + 2 * pass) * 64;
      const __m256i x00 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));  // [half][vector]
      const __m256i x10 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256i x01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
      const __m256i x11 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 96));
      const __m256i l00 = _mm256_and_si256(x00, low), h00 = _mm256_and_si256(_mm256_srli_epi16(x00, 4), low);
      const __m256i l01 = _mm256_and_si256(x01, low), h01 = _mm256_and_si256(_mm256_srli_epi16(x01, 4), low);
      const __m256i l10 = _mm256_and_si256(x10, low), h10 = _mm256_and_si256(_mm256_srli_epi16(x10, 4), low);
      const __m256i l11 = _mm256_and_si256(x11, low), h11 = _mm256_and_si256(_mm256_srli_epi16(x11, 4), low);
      const int8_t* xs = a + g * GROUP + 16 * pass;
      for (int t = 0; t < TB; ++t)
        paired16_step(xs + t * Kp, l00, h00, l01, h01, l10, h10, l11, h11, ones, ones, isum[t][0], isum[t][1]);
    }
    for (int h = 0; h < 2; ++h) group_end_avx2<TB>(d, m, g * OUT_BLOCK + h * 8, sa, sg, G, g, &isum[0][h], 2, facc[h]);
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + t * OUT_BLOCK + h * 8, facc[h][t]);
}

// One output block, TB tokens: 1-2 tokens both halves in one pass with every accumulator in
// registers (one token: each weight line read once, the bandwidth-bound decode step); 3-8 tokens
// both halves per pass with the sums in memory (avx2_paired), or, switched off, a half at a time
// in passes of up to 4 tokens.
template <int TB>
static void avx2_block(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G,
                       const uint8_t* w, const uint16_t* d, const uint16_t* m, float* out) {
  if constexpr (TB <= 2) {
    avx2_dots<TB, 2>(a, Kp, sa, sg, G, w, d, m, 0, out);
  } else {
    if (int4_paired.load(std::memory_order_relaxed)) return avx2_paired<TB>(a, Kp, sa, sg, G, w, d, m, out);
    if constexpr (TB <= 4) {
      avx2_dots<TB, 1>(a, Kp, sa, sg, G, w, d, m, 0, out);
      avx2_dots<TB, 1>(a, Kp, sa, sg, G, w, d, m, 1, out);
    } else {
      avx2_dots<4, 1>(a, Kp, sa, sg, G, w, d, m, 0, out);
      avx2_dots<4, 1>(a, Kp, sa, sg, G, w, d, m, 1, out);
      avx2_block<TB - 4>(a + 4 * Kp, Kp, sa + 4 * G, sg + 4 * G, G, w, d, m, out + 4 * OUT_BLOCK);
    }
  }
}
#endif

// The chunk's CHUNK_BLOCKS output blocks for TB tokens, out[(b * TB + t) * 16 + l], on the
// build's SIMD path (or the definition where it has none, or where reference is asked for).
template <int TB>
static void tile_dots(const int8_t* a, int64_t Kp, const float* sa, const float* sg, int64_t G, const uint8_t* w,
                      const uint16_t* d, const uint16_t* m, float* out, bool reference) {
  if (reference) return scalar_dots(TB, CHUNK_BLOCKS, a, Kp, sa, sg, G, w, d, m, out);
#if defined(FORERUN_VNNI4)
  if constexpr (TB <= 2) chunk_dots<TB, true, CHUNK_BLOCKS>(a, Kp, sa, sg, G, w, d, m, out);
  else one_by_one<TB>(a, Kp, sa, sg, G, w, d, m, out);
#elif defined(FORERUN_INT4_AVX2)
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    avx2_block<TB>(a, Kp, sa, sg, G, w + b * G * VECS * 64, d + b * G * OUT_BLOCK, m + b * G * OUT_BLOCK,
                   out + b * TB * OUT_BLOCK);
#else
  scalar_dots(TB, CHUNK_BLOCKS, a, Kp, sa, sg, G, w, d, m, out);
#endif
}

// Which SIMD path int4_rows takes on this build: "avx512-vnni", "avx2" or "scalar".
std::string int4_isa() {
#if defined(FORERUN_VNNI4)
  return "avx512-vnni";
#elif defined(FORERUN_INT4_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// x [..., K] float32; w [Mp/16, G, 8, 64] uint8; d, m [Mp/16, G, 16] float16;
// bias [M] or empty; norm_w [K] or empty (an RMSNorm folded in first) -> [..., M] float32.
// reference: the plain C++ definition on any build (for the tests: the SIMD paths give its bits).
torch::Tensor int4_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                        torch::Tensor bias, torch::Tensor norm_w, double eps, int64_t M, bool reference) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == VECS &&
              w.size(3) == 64 && w.size(0) % CHUNK_BLOCKS == 0, "w: packed uint8 [Mp/16, G, 8, 64], Mp % 32 == 0");
  const int64_t blocks = w.size(0), G = w.size(1), Kp = G * GROUP;
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && m.scalar_type() == torch::kFloat16 && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == blocks * G * OUT_BLOCK && m.numel() == d.numel(),
              "d, m: float16 [Mp/16, G, 16]");
  TORCH_CHECK(M <= blocks * OUT_BLOCK, "M: more outputs than packed");
  const auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K;
  TORCH_CHECK(Kp >= K && Kp < K + GROUP, "packed weight does not fit x");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == M, "bias: [M] or empty");
  TORCH_CHECK(norm_w.numel() == 0 || norm_w.numel() == K, "norm_w: [K] or empty");
  std::vector<int8_t> act(N * Kp);
  std::vector<float> sa(N * G), sg(N * G);
  quantize_groups_rows(x.data_ptr<float>(), N, K, Kp, norm_w.numel() ? norm_w.data_ptr<float>() : nullptr, eps,
                       act.data(), sa.data(), sg.data());
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  auto out = torch::empty(out_shape, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t chunks = blocks / CHUNK_BLOCKS;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    float acc[CHUNK_BLOCKS * MAX_TOKENS * OUT_BLOCK];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * CHUNK_BLOCKS;
      const uint8_t* wc = wp + b0 * G * VECS * 64;
      const uint16_t *dc = dp + b0 * G * OUT_BLOCK, *mc = mp + b0 * G * OUT_BLOCK;
      for (int64_t t0 = 0; t0 < N; t0 += MAX_TOKENS) {
        const int TB = static_cast<int>(std::min<int64_t>(MAX_TOKENS, N - t0));
        const int8_t* qt = act.data() + t0 * Kp;
        const float *st = sa.data() + t0 * G, *gt = sg.data() + t0 * G;
        switch (TB) {
          case 1: tile_dots<1>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 2: tile_dots<2>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 3: tile_dots<3>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 4: tile_dots<4>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 5: tile_dots<5>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 6: tile_dots<6>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          case 7: tile_dots<7>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
          default: tile_dots<8>(qt, Kp, st, gt, G, wc, dc, mc, acc, reference); break;
        }
        for (int b = 0; b < CHUNK_BLOCKS; ++b) {
          const int64_t j0 = (b0 + b) * OUT_BLOCK, n = std::min<int64_t>(OUT_BLOCK, M - j0);
          for (int t = 0; n > 0 && t < TB; ++t) {
            const float* a = acc + (b * TB + t) * OUT_BLOCK;
            float* dst = op + (t0 + t) * M + j0;
            for (int64_t l = 0; l < n; ++l) dst[l] = bp ? a[l] + bp[j0 + l] : a[l];
          }
        }
      }
    }
  });
  return out;
}
