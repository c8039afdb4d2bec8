// GGUF blocks of every native type (Q4_K, Q5_K, Q6_K and the legacy 32-value ones) rearranged
// 16 rows at a time so that a vector holds 16 outputs: the file's values, bit for bit (Q6_K's
// and the legacy types' tiles a permutation of the file's bytes; Q4_K's and Q5_K's with their
// packed 6-bit scales and mins spread to a byte each, 4 bytes more a row-block), computed with
// one VNNI instruction per 16 outputs x 4 inputs, as int4_rows.cpp does for forerun's own int4.
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
//   Q5_K     as Q4_K, with the fifth bits after the values: hi 8 vectors; vector s (sub-block
//            s), byte 4*l + j: the fifth bits of values 32s + j, 32s + 4 + j, ..., 32s + 28 + j
//            of row l, lowest first
//            2048 + 512 + 128 + 128 + 64 = 2880 bytes = 16 x 180 (the file: 16 x 176)
//   Q6_K     hi int8 [16][64] (sub-block s of 16 values: byte 4*l + j holds the top two bits
//            of values 16s + j, 16s + 4 + j, 16s + 8 + j, 16s + 12 + j of row l, lowest
//            first), sc int8 [16][16], d f16 [16]
//            2048 + 1024 + 256 + 32 = 3360 bytes = 16 x 210 (the file's size)
// and per block of 32 inputs for the legacy types (the same sizes as the file's):
//   values   Q4_0 / Q4_1 / Q5_0 / Q5_1: 4 vectors as above (value 8v + j low, 8v + 4 + j high);
//            Q8_0: 8 vectors, byte 4*l + j of vector v is value 4v + j of row l (signed)
//   hi       Q5_0 / Q5_1: 64 bytes, byte 4*l + j holds the fifth bits of values j, 4 + j, ...,
//            28 + j of row l, lowest first
//   d f16 [16], and m f16 [16] for Q4_1 / Q5_1
//            Q4_0 288 = 16 x 18, Q4_1 320 = 16 x 20, Q5_0 352 = 16 x 22, Q5_1 384 = 16 x 24,
//            Q8_0 544 = 16 x 34 bytes
// Numerics, per row, token and block, with qa / da / bsum the activations as gguf_rows.cpp
// quantizes them (int8 per block of the weight's width, 256 or 32 values, scale da, sums per 16):
//   Q4_K, Q5_K  I = sum_s sc_s * (sum_{i in s} q_i qa_i),  Mn = sum_s mn_s * bsum32_s  (int32, exact)
//         acc = fma(float(I), d * da, acc);  acc = fma(-float(Mn), dmin * da, acc)
//   Q6_K  I = sum_s sc_s * (sum_{i in s} q_i qa_i - 32 * bsum_s)                  (int32, exact)
//         acc = fma(float(I), d * da, acc)
//   legacy, activations int8 per 32 values (scale da, sum S): I = sum_i q_i qa_i - off * S
//         (off 8 for Q4_0, 16 for Q5_0, else 0; Q8_0's q signed; int32, exact)
//         acc = fma(float(I), d * da, acc);  Q4_1 / Q5_1: acc = fma(float(S), m * da, acc)
// blocks in order, then y = acc (+ bias). The AVX512-VNNI path and the scalar one run these
// operations in this order, so they give the same bits; every token gets its own accumulator
// whatever its batch-mates (batch invariance, as in gguf_rows.cpp).
//
// AVX2 (with FMA and F16C) runs the same operations 8 rows at a time (half of each 64-byte
// vector): vpdpbusd's exact int32 sums as maddubs + madd, a sub-block's scale applied by that
// madd (the same integer sum_s sc_s * dot_s), Q8_0's signed bytes as |q| . sign(qa, q), and
// the VNNI path's float operations lane for lane: the same bits (tests/test_gguf_packed.py holds
// each SIMD path to the plain C++ definition with torch.equal). Q4_K and Q6_K take both halves
// per broadcast of the activations (tile_dots_q4k_avx2, tile_dots_q6k_avx2): one pass over a
// tile's bytes instead of two, and half the broadcasts. The 1.5B's MLP and attention
// matrices, 512 tokens, 2 threads, a Zen 3 EPYC without AVX512: 259 ms against the row
// kernel's 505 ms; one token 1.9 against 4.7 ms (matrices in cache).
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
#include <utility>
#include <atomic>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_GGUF_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FORERUN_GGUF_AVX2 1
#endif

void gguf_quantize_acts(const float* x, int64_t N, int64_t K, int64_t qk, int8_t* qa, float* da,
                        int16_t* bsum);                                                            // gguf_rows.cpp
void gguf_dequant_values(int64_t type, int64_t qk, const uint8_t* q, const int16_t* sc, const int16_t* mn, float d,
                         float dmin, float* o);                                                    // gguf_rows.cpp

namespace {

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, LANES = 16, QK = 256;
constexpr int64_t MAX_TB = 8;  // tokens per pass over a tile's weights (8 vs 4: 8 tokens 23.3 -> 21.4 ms below)
// Ask for the weights 20 KB ahead into L2, as int4_rows.cpp does: 26 Q4_K / Q6_K matrices of the
// 1.5B's MLP shapes (0.37 GB, more than the caches), median of 5 interleaved rounds, this 2-core
// AVX512-VNNI EPYC: 1 token 21.3 -> 14.4 ms (17 -> 26 GB/s), 4 tokens 33.7 -> 14.3 ms, against
// 6 blocks ahead into L1; 40 KB ahead changes nothing.
constexpr int64_t PREFETCH_BYTES = 20480;

struct Packed {
  int64_t qk, src_bytes, bytes;  // values per block; bytes per row-block in the file, per 16-row tile-block here
  int64_t sc, mn, hi, d, dmin;   // offsets of the fields (-1: absent); legacy: hi = fifth bits, dmin = m
  int64_t off;                   // legacy: the q offset (w = d * (q - off)); Q8_0: 0, its q signed
};

constexpr Packed layout_of(int64_t type) {
  switch (type) {
    case Q4_K: return {256, 144, 2368, 2048, 2176, -1, 2304, 2336, 0};
    case Q5_K: return {256, 176, 2880, 2560, 2688, 2048, 2816, 2848, 0};
    case Q6_K: return {256, 210, 3360, 3072, -1, 2048, 3328, -1, 0};
    case Q4_0: return {32, 18, 288, -1, -1, -1, 256, -1, 8};
    case Q4_1: return {32, 20, 320, -1, -1, -1, 256, 288, 0};
    case Q5_0: return {32, 22, 352, -1, -1, 256, 320, -1, 16};
    case Q5_1: return {32, 24, 384, -1, -1, 256, 320, 352, 0};
    case Q8_0: return {32, 34, 544, -1, -1, -1, 512, -1, 0};
  }
  return {0, 0, 0, -1, -1, -1, -1, -1, 0};
}

Packed packed_of(int64_t type) {
  const Packed P = layout_of(type);
  TORCH_CHECK(P.qk, "GGUF block type ", type, " has no packed kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K do)");
  return P;
}

constexpr bool legacy(int64_t type) { return layout_of(type).qk == 32; }
constexpr bool k_min(int64_t type) { return type == Q4_K || type == Q5_K; }  // w = d sc q - dmin mn

// The fields of one tile-block as runs of 16 lanes x `width` bytes: what moves with a row.
std::vector<std::pair<int64_t, int64_t>> lane_runs(int64_t type) {  // (offset, width)
  std::vector<std::pair<int64_t, int64_t>> runs;
  const Packed P = packed_of(type);
  if (legacy(type)) {
    for (int64_t v = 0; v < (type == Q8_0 ? 8 : 4); ++v) runs.push_back({64 * v, 4});
    if (P.hi >= 0) runs.push_back({P.hi, 4});
    runs.push_back({P.d, 2});
    if (P.dmin >= 0) runs.push_back({P.dmin, 2});
    return runs;
  }
  for (int64_t v = 0; v < 32; ++v) runs.push_back({64 * v, 4});
  if (type == Q5_K)
    for (int64_t s = 0; s < 8; ++s) runs.push_back({P.hi + 64 * s, 4});
  if (k_min(type)) {
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

// The fifth bits of 32 values q[0..31] into lane l's 4 bytes of a hi vector (byte j: bit o
// from value 4o + j), and back: Q5_0 / Q5_1 per block, Q5_K per sub-block of 32.
void pack_fifth_bits(const uint8_t* q, int64_t l, uint8_t* hi) {
  for (int j = 0; j < 4; ++j) {
    uint8_t h = 0;
    for (int o = 0; o < 8; ++o) h |= ((q[4 * o + j] >> 4) & 1) << o;
    hi[4 * l + j] = h;
  }
}

void unpack_fifth_bits(const uint8_t* hi, int64_t l, uint8_t* q) {
  for (int j = 0; j < 4; ++j)
    for (int o = 0; o < 8; ++o) q[4 * o + j] |= ((hi[4 * l + j] >> o) & 1) << 4;
}

// One row's block (the file's bytes `src`) into lane l of a tile-block.
void pack_lane(int64_t type, const uint8_t* src, int64_t l, uint8_t* dst) {
  uint8_t q[256];
  int16_t sc[16], mn[16];
  gguf_decode_block(type, src, q, sc, mn);
  const Packed P = packed_of(type);
  if (type == Q8_0) {
    for (int v = 0; v < 8; ++v)
      for (int j = 0; j < 4; ++j) dst[64 * v + 4 * l + j] = q[4 * v + j];
  } else {
    for (int v = 0; v < P.qk / 8; ++v)
      for (int j = 0; j < 4; ++j) dst[64 * v + 4 * l + j] = (q[8 * v + j] & 15) | ((q[8 * v + 4 + j] & 15) << 4);
  }
  if (legacy(type)) {  // d (and m) lead the file's block
    if (P.hi >= 0) pack_fifth_bits(q, l, dst + P.hi);
    std::memcpy(dst + P.d + 2 * l, src, 2);
    if (P.dmin >= 0) std::memcpy(dst + P.dmin + 2 * l, src + 2, 2);
    return;
  }
  if (type == Q5_K)  // sub-block s: the fifth bits of its 32 values, as the legacy types' per 32
    for (int s = 0; s < 8; ++s) pack_fifth_bits(q + 32 * s, l, dst + P.hi + 64 * s);
  if (k_min(type)) {
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
// Legacy types as gguf_rows.cpp's decode_block gives them: sc 1, mn the offset (or 1 with
// dmin = -m for Q4_1 / Q5_1, 0 for Q8_0).
void unpack_lane(int64_t type, const uint8_t* blk, int64_t l, uint8_t* q, int16_t* sc, int16_t* mn, float* d, float* dmin) {
  const Packed P = packed_of(type);
  if (type == Q8_0) {
    for (int v = 0; v < 8; ++v)
      for (int j = 0; j < 4; ++j) q[4 * v + j] = blk[64 * v + 4 * l + j];
  } else {
    for (int v = 0; v < P.qk / 8; ++v)
      for (int j = 0; j < 4; ++j) {
        const uint8_t b = blk[64 * v + 4 * l + j];
        q[8 * v + j] = b & 15;
        q[8 * v + 4 + j] = b >> 4;
      }
  }
  *d = f16(blk + P.d + 2 * l);
  if (legacy(type)) {
    if (P.hi >= 0) unpack_fifth_bits(blk + P.hi, l, q);
    sc[0] = sc[1] = 1;
    mn[0] = mn[1] = P.dmin >= 0 ? 1 : P.off;
    *dmin = P.dmin >= 0 ? -f16(blk + P.dmin + 2 * l) : type == Q8_0 ? 0.f : *d;
    return;
  }
  if (k_min(type)) {  // (Q5_K's scales and mins are 6-bit: unsigned below 64, as int8 too)
    if (type == Q5_K)
      for (int s = 0; s < 8; ++s) unpack_fifth_bits(blk + P.hi + 64 * s, l, q + 32 * s);
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

// Activations as the packed kernels read them: qa [N, K], da [N, K/qk], and per token
// qk 256, Q4_K: the sums of 32 values in pairs as int16 x 2 (bp [N, K/64]); Q6_K: 32 x the
// sums of 16 values (b32 [N, K/16]); qk 32: the sums of each block's 32 values (s32 [N, K/32]).
struct Acts {
  int64_t qk = 0;
  std::vector<int8_t> qa;
  std::vector<float> da;
  std::vector<int32_t> bp, b32, s32;
  std::vector<int32_t> b16p;  // qk 256: the sums of 16 values in pairs as int16 x 2 [N, K/32] (Q6_K's AVX2 tile)
};

Acts quantize(const float* x, int64_t N, int64_t K, int64_t qk) {
  Acts a;
  a.qk = qk;
  a.qa.resize(N * K);
  a.da.resize(N * (K / qk));
  std::vector<int16_t> bsum(N * (K / 16));
  gguf_quantize_acts(x, N, K, qk, a.qa.data(), a.da.data(), bsum.data());
  if (qk == 32) {
    a.s32.resize(N * (K / 32));
    for (int64_t i = 0; i < N * (K / 32); ++i) a.s32[i] = int32_t(bsum[2 * i]) + bsum[2 * i + 1];
    return a;
  }
  a.bp.resize(N * (K / 64));
  a.b32.resize(N * (K / 16));
#ifdef FORERUN_GGUF_AVX2
  a.b16p.resize(N * (K / 32));
  for (int64_t i = 0; i < N * (K / 32); ++i)
    a.b16p[i] = int32_t((uint32_t(uint16_t(bsum[2 * i + 1])) << 16) | uint16_t(bsum[2 * i]));
#endif
  for (int64_t i = 0; i < N * (K / 16); ++i) a.b32[i] = 32 * int32_t(bsum[i]);
  for (int64_t i = 0; i < N * (K / 64); ++i) {
    const int32_t s0 = int32_t(bsum[4 * i]) + bsum[4 * i + 1], s1 = int32_t(bsum[4 * i + 2]) + bsum[4 * i + 3];
    a.bp[i] = int32_t((uint32_t(uint16_t(int16_t(s1))) << 16) | uint16_t(int16_t(s0)));
  }
  return a;
}

#if defined(FORERUN_GGUF_VNNI) || defined(FORERUN_GGUF_AVX2)
// Ask for part `part` of `parts` of the tile-block `bytes` long whose start is
// PREFETCH_BYTES after blk (see above): a K-quant tile asks for one part per sub-block, so
// its ~40 requests go out between the dot products rather than in one burst, which stalls
// on the core's queue of outstanding misses (perf put 13% of the 4-token Q4_K tile's
// samples on the burst's loop). The 1.5B's forward, one process, burst / spread alternated
// per round (25 rounds, medians): 1 token 33.9 / 32.3 ms, 4 tokens 39.9 / 38.1, 8 tokens
// 61.5 / 58.4 (a slower hour: 35.1 / 34.8, 41.4 / 41.1, 64.5 / 63.2); 10 KB or 40 KB ahead,
// or into L1 (T0 / NTA), were no better.
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* blk, int64_t bytes, int part = 0,
                                                          int parts = 1) {
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t c = lines * part / parts; c < lines * (part + 1) / parts; ++c)
    _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES + 64 * c), _MM_HINT_T1);
}
#endif

#ifdef FORERUN_GGUF_VNNI

// acc + w (16 x 4 unsigned bytes) . the 4 signed bytes at a, broadcast by the instruction
// itself ({1to16}, a memory operand): GCC emits a separate vpbroadcastd before each
// _mm512_dpbusd_epi32 of _mm512_set1_epi32, a uop more per dot product. The 1.5B's forward,
// one process, separate / embedded broadcast alternated (20 rounds, medians, two sittings):
// 1 token 32.1 / 31.0 and 32.0 / 31.9 ms, 4 tokens 42.1 / 39.4 and 58.4 / 55.6, 8 tokens
// 68.4 / 63.3 and 104.1 / 93.4. The same integer sums.
__attribute__((always_inline)) inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t* a) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(a)));
  return acc;
}

// One nibble vector's two operands against TB tokens: lo holds inputs k..k+3 of the 16 rows,
// hi inputs k+4..k+7; a points at token 0's input k (tokens K apart).
template <int TB>
__attribute__((always_inline)) inline void nibble_pair_dots(__m512i lo, __m512i hi, const int8_t* a, int64_t K, __m512i* dot) {
  for (int t = 0; t < TB; ++t) {
    dot[t] = dpbusd_bcst(dot[t], lo, a + t * K);
    dot[t] = dpbusd_bcst(dot[t], hi, a + t * K + 4);
  }
}

// Bit `bit` of every byte of h moved to 16 (16-bit lanes shifted by at most 4 left or 3 right:
// no bit crosses into the next byte), the rest 0: a fifth bit as Q5_0 / Q5_1 / Q5_K add it.
__attribute__((always_inline)) inline __m512i fifth_bit(__m512i h, int bit) {
  return _mm512_and_si512(bit <= 4 ? _mm512_slli_epi16(h, 4 - bit) : _mm512_srli_epi16(h, bit - 4), _mm512_set1_epi8(16));
}
#elif defined(FORERUN_GGUF_AVX2)
// The VNNI path's operations on 8 rows at a time (half of a 64-byte vector).
__attribute__((always_inline)) inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

__attribute__((always_inline)) inline __m256i bcst4(const int8_t* a) {  // 4 signed bytes in every lane
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}

__attribute__((always_inline)) inline __m256 half8(const uint8_t* p) {  // 8 f16 -> f32, exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((always_inline)) inline __m256i fifth_bit(__m256i h, int bit) {
  return _mm256_and_si256(bit <= 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4), _mm256_set1_epi8(16));
}

// One token's dot product over VECS pairs of unpacked weight vectors held in registers (lo[v]:
// inputs 8v..8v+3 of 8 rows, hi[v]: 8v+4..8v+7; a: the token's input 0): each group of SUM16
// pairs' maddubs results summed in int16, then one madd by `scale` (a row's 16-bit factor in
// both halves of its lane: a sub-block's scale, or ones) -> int32 lanes, exact while a group's
// sums stay in int16 (the callers' bounds). The K-quant and legacy AVX2 tiles both call it.
template <int VECS, int SUM16>
__attribute__((always_inline)) inline __m256i nibble_dot(const __m256i* lo, const __m256i* hi, const int8_t* a, __m256i scale) {
  static_assert(VECS % SUM16 == 0, "whole int16 groups");
  __m256i dot = _mm256_setzero_si256();
  for (int g = 0; g < VECS; g += SUM16) {
    __m256i p = _mm256_setzero_si256();
    for (int v = g; v < g + SUM16; ++v)
      p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], bcst4(a + 8 * v)),
                                               _mm256_maddubs_epi16(hi[v], bcst4(a + 8 * v + 4))));
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, scale));
  }
  return dot;
}
#endif

// The packed kernels' definition, one lane and token at a time: what the SIMD paths compute,
// bit for bit (reference=True in gguf_packed_rows runs it on any build, for the tests).
template <int64_t TYPE, int TB>
void scalar_dots32(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* s32,
                   float* out) {
  constexpr Packed P = layout_of(TYPE);
  for (int t = 0; t < TB; ++t)
    for (int64_t l = 0; l < LANES; ++l) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t q[256];
        int16_t sc[16], mn[16];
        float d, dmin;
        unpack_lane(TYPE, w + b * P.bytes, l, q, sc, mn, &d, &dmin);
        const int8_t* x = qa + t * K + b * 32;
        const int32_t S = s32[t * nb + b];
        int32_t I = 0;
        for (int i = 0; i < 32; ++i) I += (TYPE == Q8_0 ? int32_t(int8_t(q[i])) : int32_t(q[i])) * int32_t(x[i]);
        I -= int32_t(P.off) * S;
        const float dd = da[t * nb + b];
        acc = std::fma(float(I), d * dd, acc);
        if (P.dmin >= 0) acc = std::fma(float(S), -dmin * dd, acc);  // dmin = -m
      }
      out[LANES * t + l] = acc;
    }
}

template <int64_t TYPE, int TB>
void scalar_dots(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* bp,
                 const int32_t* b32, float* out) {
  constexpr Packed P = layout_of(TYPE);
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
        const int sub = k_min(TYPE) ? 32 : 16;
        for (int s = 0; s < QK / sub; ++s) {
          int32_t dot = 0;
          for (int i = sub * s; i < sub * (s + 1); ++i) dot += int32_t(q[i]) * int32_t(x[i]);
          if (TYPE == Q6_K) dot -= b32[t * (K / 16) + b * 16 + s];
          isum += dot * int32_t(sc[sub / 16 * s]);
        }
        const float dd = da[t * nb + b];
        acc = std::fma(float(isum), d * dd, acc);
        if (k_min(TYPE)) {
          for (int p = 0; p < 4; ++p) {
            const int32_t pair = bp[t * (K / 64) + 4 * b + p];
            msum += int32_t(mn[4 * p]) * int32_t(int16_t(pair & 0xFFFF)) + int32_t(mn[4 * p + 2]) * int32_t(int16_t(uint32_t(pair) >> 16));
          }
          acc = std::fma(-float(msum), dmin * dd, acc);
        }
      }
      out[LANES * t + l] = acc;
    }
}

// One tile (16 rows) of a legacy type (blocks of 32) for TB tokens: out[t * 16 + l]. qa, da,
// s32 point at token 0.
template <int64_t TYPE, int TB>
void tile_dots32(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* s32,
                 float* out) {
  constexpr Packed P = layout_of(TYPE);
#ifdef FORERUN_GGUF_VNNI
  const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(-128);
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * P.bytes;
    prefetch_ahead(blk, P.bytes);
    __m512i dot[TB];
    for (int t = 0; t < TB; ++t) dot[t] = _mm512_setzero_si512();
    const int8_t* xb = qa + b * 32;
    if constexpr (TYPE == Q8_0) {  // (q + 128) . qa, the 128 x S taken off below
      for (int v = 0; v < 8; ++v) {
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * v), flip);
        for (int t = 0; t < TB; ++t) dot[t] = dpbusd_bcst(dot[t], u, xb + t * K + 4 * v);
      }
    } else {
      __m512i hv = _mm512_setzero_si512();
      if constexpr (P.hi >= 0) hv = _mm512_loadu_si512(blk + P.hi);
      for (int v = 0; v < 4; ++v) {
        const __m512i x = _mm512_loadu_si512(blk + 64 * v);
        __m512i lo = _mm512_and_si512(x, m4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
        if constexpr (P.hi >= 0) {  // values 8v + j and 8v + 4 + j: fifth bits 2v and 2v + 1
          lo = _mm512_or_si512(lo, fifth_bit(hv, 2 * v));
          hi = _mm512_or_si512(hi, fifth_bit(hv, 2 * v + 1));
        }
        nibble_pair_dots<TB>(lo, hi, xb + 8 * v, K, dot);
      }
    }
    constexpr int32_t OFF = TYPE == Q8_0 ? 128 : int32_t(P.off);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.d)));
    for (int t = 0; t < TB; ++t) {
      const int32_t S = s32[t * nb + b];
      const __m512 dd = _mm512_set1_ps(da[t * nb + b]);
      __m512i I = dot[t];
      if constexpr (OFF != 0) I = _mm512_sub_epi32(I, _mm512_set1_epi32(OFF * S));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dv, dd), acc[t]);
      if constexpr (P.dmin >= 0) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.dmin)));
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(float(S)), _mm512_mul_ps(mv, dd), acc[t]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + LANES * t, acc[t]);
#elif defined(FORERUN_GGUF_AVX2)
  // Two passes of 8 rows (a vector's 32 bytes: half h of each 64-byte one). maddubs + madd by
  // ones is vpdpbusd's exact int32 (no pair of products leaves int16: at most 2 x 31 x 127);
  // Q8_0's signed bytes as |q| . sign(qa, q) (at most 2 x 128 x 127), so its I needs no offset.
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[TB];
    for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * P.bytes;
      if (h == 0) prefetch_ahead(blk, P.bytes);
      __m256i dot[TB];
      for (int t = 0; t < TB; ++t) dot[t] = _mm256_setzero_si256();
      const int8_t* xb = qa + b * 32;
      // As the K-quant tiles: the block's weights in registers once, then each token's dot
      // product over them (GCC spills less than with every token's products in flight).
      if constexpr (TYPE == Q8_0) {
        for (int v0 = 0; v0 < 8; v0 += 4) {  // 4 vectors and their magnitudes: 8 registers
          __m256i u[4], au[4];
          for (int v = 0; v < 4; ++v) {
            u[v] = load32(blk + 64 * (v0 + v) + 32 * h);
            au[v] = _mm256_abs_epi8(u[v]);
          }
          for (int t = 0; t < TB; ++t)
            for (int v = 0; v < 4; ++v)
              dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(au[v], _mm256_sign_epi8(bcst4(xb + t * K + 4 * (v0 + v)), u[v])), ones));
        }
      } else {
        // A lane sums SUM16 vectors' maddubs results in int16 before the madd by ones: values of
        // 4 bits 8 pairs of at most 2 x 15 x 127 (30480), of 5 bits 4 pairs (4 x 2 x 31 x 127 = 31496).
        constexpr int SUM16 = P.hi >= 0 ? 2 : 4;
        __m256i hv = _mm256_setzero_si256();
        if constexpr (P.hi >= 0) hv = load32(blk + P.hi + 32 * h);
        __m256i lo[4], hi[4];
        for (int v = 0; v < 4; ++v) {
          const __m256i x = load32(blk + 64 * v + 32 * h);
          lo[v] = _mm256_and_si256(x, m4);
          hi[v] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
          if constexpr (P.hi >= 0) {
            lo[v] = _mm256_or_si256(lo[v], fifth_bit(hv, 2 * v));
            hi[v] = _mm256_or_si256(hi[v], fifth_bit(hv, 2 * v + 1));
          }
        }
        for (int t = 0; t < TB; ++t) dot[t] = _mm256_add_epi32(dot[t], nibble_dot<4, SUM16>(lo, hi, xb + t * K, ones));
      }
      constexpr int32_t OFF = TYPE == Q8_0 ? 0 : int32_t(P.off);
      const __m256 dv = half8(blk + P.d + 16 * h);
      for (int t = 0; t < TB; ++t) {
        const int32_t S = s32[t * nb + b];
        const __m256 dd = _mm256_set1_ps(da[t * nb + b]);
        __m256i I = dot[t];
        if constexpr (OFF != 0) I = _mm256_sub_epi32(I, _mm256_set1_epi32(OFF * S));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(dv, dd), acc[t]);
        if constexpr (P.dmin >= 0)
          acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(float(S)), _mm256_mul_ps(half8(blk + P.dmin + 16 * h), dd), acc[t]);
      }
    }
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + LANES * t + 8 * h, acc[t]);
  }
#else
  scalar_dots32<TYPE, TB>(w, nb, qa, K, da, s32, out);
#endif
}

// Benchmark switch: false sends Q4_K and Q6_K through tile_dots' AVX2 loop (one 8-row half at
// a time, as Q5_K still runs) instead of their paired tiles below: the same bits, so
// scripts/gguf_tiles_ab.py can time both in one process.
std::atomic<bool> paired_halves{true};
// Tokens per pass of the paired tiles (1 to PAIRED_MAX_TB; another benchmark switch): their
// accumulators live in memory, not registers, so a pass may take up to 16 tokens, and a
// verifier forward of 9 to 16 tokens unpacks each tile's weights once instead of twice (as
// does a prefill chunk half as often). Each token's instructions are the same whatever the
// pass holds: the same bits.
constexpr int PAIRED_MAX_TB = 16;
std::atomic<int> paired_tokens{PAIRED_MAX_TB};
#ifdef FORERUN_GGUF_AVX2
// The paired tiles' shared pieces (the token step and BROADCAST_16_INPUTS are paired16.h's).
// A sub-block's scale for each row of the two halves (sc: its 16 int8, row l at sc[l]), in both
// 16-bit halves of the row's int32 lane: the madd operand of tile_dots' AVX2 loop.
__attribute__((always_inline)) inline void sub_block_scales(const uint8_t* sc, __m256i* sc16) {
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  for (int h = 0; h < 2; ++h) {
    const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h)));
    sc16[h] = _mm256_or_si256(_mm256_and_si256(sc32, low16), _mm256_slli_epi32(sc32, 16));
  }
}

// Q6_K: the top two bits of operands 2v (lo) and 2v + 1 (hi) of a sub-block's nibble vector v,
// from its hi vector hv (bit pairs 4v and 4v + 2, moved to bits 4-5), ORed into the 4-bit values.
__attribute__((always_inline)) inline void q6k_top_bits(__m256i hv, int v, __m256i& lo, __m256i& hi) {
  const __m256i m30 = _mm256_set1_epi8(0x30);
  const __m256i h0 = v == 0 ? _mm256_slli_epi16(hv, 4) : hv;
  const __m256i h1 = v == 0 ? _mm256_slli_epi16(hv, 2) : _mm256_srli_epi16(hv, 2);
  lo = _mm256_or_si256(lo, _mm256_and_si256(h0, m30));
  hi = _mm256_or_si256(hi, _mm256_and_si256(h1, m30));
}

// The end of a Q4_K / Q5_K block on rows 8h..8h+7 of a tile: each token's minimums (int32 sums
// by madd: the mins of sub-blocks 2p and 2p + 1 against its 32-value sums in pairs), then
// acc[t] = fma(isum, d da, acc[t]) and acc[t] -= msum dmin da, in that order (the VNNI path's float
// operations). isum[t * stride] is token t's int32 sum of the block.
template <int64_t TYPE, int TB>
__attribute__((always_inline)) inline void kmin_block_end(const uint8_t* blk, int h, int64_t b, int64_t nb, int64_t K,
                                                          const int32_t* bp, const float* da, const __m256i* isum,
                                                          int stride, __m256* acc) {
  constexpr Packed P = layout_of(TYPE);
  const __m256 dv = half8(blk + P.d + 16 * h), mv = half8(blk + P.dmin + 16 * h);
  __m256i msum[TB];
  for (int t = 0; t < TB; ++t) msum[t] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const __m256i mn = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + P.mn + 32 * p + 16 * h)));
    for (int t = 0; t < TB; ++t)
      msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mn, _mm256_set1_epi32(bp[t * (K / 64) + 4 * b + p])));
  }
  for (int t = 0; t < TB; ++t) {
    const __m256 dd = _mm256_set1_ps(da[t * nb + b]);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t * stride]), _mm256_mul_ps(dv, dd), acc[t]);
    acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[t]), _mm256_mul_ps(mv, dd), acc[t]);
  }
}

// Q4_K on AVX2: both 8-row halves of a 64-byte vector at once, so each broadcast of 4
// activations serves two maddubs (the K-quant loop below broadcasts once per maddubs, and
// broadcasts from memory cost about a maddubs each on Zen 3: 8 maddubs + 8 adds + 8
// broadcasts 1.65 ns, with 4 broadcasts 1.26 ns, the maddubs alone 1.26). A sub-block's 4
// vectors go in two passes of 2, whose 8 unpacked weight vectors stay in registers while
// every token's step runs (paired16.h's, in inline assembly, shared with int4_rows.cpp). Each
// pass sums 4 maddubs results per row in int16 (at most 4 x 2 x 15 x 127 = 15240) before the
// scale's madd: the same exact int32 sums as tile_dots' AVX2 loop, and its float operations
// per block in its order, so the same bits (tests/test_gguf_packed.py). And one pass over a
// tile's bytes where that loop made two (a half each, every cache line read twice). Timed
// against that loop on a 1008 x 1536 matrix in cache, 1 thread, 8 tokens, this 2-core Zen 3
// EPYC (standalone, alternated): 95-96 -> 100-107 G multiply-accumulates/s in its fast
// phases; the 1.5B's forwards with both paired tiles: scripts/gguf_tiles_ab.py.
template <int TB>
void tile_dots_q4k_avx2(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* bp,
                        float* out) {
  constexpr Packed P = layout_of(Q4_K);
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[2][TB];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) acc[h][t] = _mm256_setzero_ps();
  alignas(32) __m256i isum[TB][2];  // per token: rows 0-7, rows 8-15
  alignas(32) __m256i sc16[2];      // the sub-block's scale per row of each half, in both 16-bit halves of a lane
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * P.bytes;
    for (int t = 0; t < TB; ++t) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      prefetch_ahead(blk, P.bytes, s, 8);
      sub_block_scales(blk + P.sc + 16 * s, sc16);
      for (int pass = 0; pass < 2; ++pass) {  // vectors 4s + 2 pass and 4s + 2 pass + 1: inputs 32s + 16 pass ..
        const uint8_t* x = blk + 64 * (4 * s + 2 * pass);
        const __m256i x00 = load32(x), x01 = load32(x + 64), x10 = load32(x + 32), x11 = load32(x + 96);  // [half][vector]
        const __m256i l00 = _mm256_and_si256(x00, m4), h00 = _mm256_and_si256(_mm256_srli_epi16(x00, 4), m4);
        const __m256i l01 = _mm256_and_si256(x01, m4), h01 = _mm256_and_si256(_mm256_srli_epi16(x01, 4), m4);
        const __m256i l10 = _mm256_and_si256(x10, m4), h10 = _mm256_and_si256(_mm256_srli_epi16(x10, 4), m4);
        const __m256i l11 = _mm256_and_si256(x11, m4), h11 = _mm256_and_si256(_mm256_srli_epi16(x11, 4), m4);
        const int8_t* xs = qa + b * QK + 32 * s + 16 * pass;
        for (int t = 0; t < TB; ++t) {
          paired16_step(xs + t * K, l00, h00, l01, h01, l10, h10, l11, h11, sc16[0], sc16[1], isum[t][0], isum[t][1]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) kmin_block_end<Q4_K, TB>(blk, h, b, nb, K, bp, da, &isum[0][h], 2, acc[h]);
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + LANES * t + 8 * h, acc[h][t]);
}

// Q6_K on AVX2, as tile_dots_q4k_avx2: a sub-block's 2 vectors of both halves (8 unpacked
// registers: 4-bit values with their top 2 bits, 0..63) against each token's 16 inputs, one
// madd per vector (2 x 2 x 63 x 127 = 32004 fits int16, two vectors would not). The
// 32 x bsum term is taken off once a block rather than once a sub-block: 32 x sum_s sc_s
// bsum_s per row, by madd over pairs of sub-blocks (each row's two scales side by side in
// int16 against the token's two 16-value sums), where the K-quant loop below runs a vpmulld
// per sub-block and token. Exact int32 either way (sum_s sc_s dot_s stays within 16 x 128 x
// 16 x 63 x 127 < 2^31 before the term comes off), so the same bits. Standalone, as above:
// 72 -> 77-80 G multiply-accumulates/s.
template <int TB>
void tile_dots_q6k_avx2(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da,
                        const int32_t* b16p, float* out) {
  constexpr Packed P = layout_of(Q6_K);
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[2][TB];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) acc[h][t] = _mm256_setzero_ps();
  alignas(32) __m256i isum[TB][2];
  alignas(32) __m256i sc16[2];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * P.bytes;
    for (int t = 0; t < TB; ++t) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
    for (int s = 0; s < 16; ++s) {
      prefetch_ahead(blk, P.bytes, s, 16);
      sub_block_scales(blk + P.sc + 16 * s, sc16);
      __m256i wl[2][2], wh[2][2];  // [half][vector]: operands 2v (lo) and 2v + 1 (hi), top bits as tile_dots
      for (int h = 0; h < 2; ++h) {
        const __m256i hv = load32(blk + P.hi + 64 * s + 32 * h);
        for (int v = 0; v < 2; ++v) {
          const __m256i x = load32(blk + 64 * (2 * s + v) + 32 * h);
          wl[h][v] = _mm256_and_si256(x, m4);
          wh[h][v] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
          q6k_top_bits(hv, v, wl[h][v], wh[h][v]);
        }
      }
      const int8_t* xs = qa + b * QK + 16 * s;
      for (int t = 0; t < TB; ++t) {
        // isum[t][h] += madd(sc16[h], maddubs(wl[h][0], a0..3) + maddubs(wh[h][0], a4..7))
        //             + madd(sc16[h], maddubs(wl[h][1], a8..11) + maddubs(wh[h][1], a12..15))
        asm volatile(
            BROADCAST_16_INPUTS
            "vpmaddubsw %%ymm12, %[l00], %%ymm8\n\t"
            "vpmaddubsw %%ymm13, %[h00], %%ymm9\n\t"
            "vpmaddubsw %%ymm14, %[l01], %%ymm10\n\t"
            "vpmaddubsw %%ymm15, %[h01], %%ymm11\n\t"
            "vpaddw %%ymm9, %%ymm8, %%ymm8\n\t"
            "vpaddw %%ymm11, %%ymm10, %%ymm10\n\t"
            "vpmaddwd %[s0], %%ymm8, %%ymm8\n\t"
            "vpmaddwd %[s0], %%ymm10, %%ymm10\n\t"
            "vpaddd %%ymm10, %%ymm8, %%ymm8\n\t"
            "vpaddd %[i0], %%ymm8, %%ymm8\n\t"
            "vmovdqa %%ymm8, %[i0]\n\t"
            "vpmaddubsw %%ymm12, %[l10], %%ymm9\n\t"
            "vpmaddubsw %%ymm13, %[h10], %%ymm10\n\t"
            "vpmaddubsw %%ymm14, %[l11], %%ymm11\n\t"
            "vpmaddubsw %%ymm15, %[h11], %%ymm12\n\t"
            "vpaddw %%ymm10, %%ymm9, %%ymm9\n\t"
            "vpaddw %%ymm12, %%ymm11, %%ymm11\n\t"
            "vpmaddwd %[s1], %%ymm9, %%ymm9\n\t"
            "vpmaddwd %[s1], %%ymm11, %%ymm11\n\t"
            "vpaddd %%ymm11, %%ymm9, %%ymm9\n\t"
            "vpaddd %[i1], %%ymm9, %%ymm9\n\t"
            "vmovdqa %%ymm9, %[i1]\n\t"
            : [i0] "+m"(isum[t][0]), [i1] "+m"(isum[t][1])
            : [a] "r"(xs + t * K), [in] "m"(inputs16(xs + t * K)), [l00] "x"(wl[0][0]), [h00] "x"(wh[0][0]), [l01] "x"(wl[0][1]), [h01] "x"(wh[0][1]),
              [l10] "x"(wl[1][0]), [h10] "x"(wh[1][0]), [l11] "x"(wl[1][1]), [h11] "x"(wh[1][1]), [s0] "m"(sc16[0]),
              [s1] "m"(sc16[1])
            : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i scp[8];  // sub-blocks 2q and 2q + 1: row l's scales in int16 lanes 2l and 2l + 1
      for (int q = 0; q < 8; ++q) {
        const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + P.sc + 16 * (2 * q) + 8 * h));
        const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + P.sc + 16 * (2 * q + 1) + 8 * h));
        scp[q] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
      }
      const __m256 dv = half8(blk + P.d + 16 * h);
      for (int t = 0; t < TB; ++t) {
        __m256i bs = _mm256_setzero_si256();
        for (int q = 0; q < 8; ++q)
          bs = _mm256_add_epi32(bs, _mm256_madd_epi16(scp[q], _mm256_set1_epi32(b16p[t * (K / 32) + 8 * b + q])));
        const __m256i is = _mm256_sub_epi32(isum[t][h], _mm256_slli_epi32(bs, 5));
        acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dv, _mm256_set1_ps(da[t * nb + b])), acc[h][t]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + LANES * t + 8 * h, acc[h][t]);
}
#endif

// One tile (16 rows) for TB tokens: out[t * 16 + l]. qa, da, bp / b32 point at token 0.
template <int64_t TYPE, int TB>
void tile_dots(const uint8_t* w, int64_t nb, const int8_t* qa, int64_t K, const float* da, const int32_t* bp,
               const int32_t* b32, float* out) {
  constexpr Packed P = layout_of(TYPE);
#ifdef FORERUN_GGUF_VNNI
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * P.bytes;
    __m512i isum[TB];
    for (int t = 0; t < TB; ++t) isum[t] = _mm512_setzero_si512();
    constexpr int SUBS = k_min(TYPE) ? 8 : 16, VECS = 32 / SUBS;  // nibble vectors per sub-block
    for (int s = 0; s < SUBS; ++s) {
      prefetch_ahead(blk, P.bytes, s, SUBS);
      const __m512i scv = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + P.sc + 16 * s)));
      __m512i hv = _mm512_setzero_si512();
      if constexpr (P.hi >= 0) hv = _mm512_loadu_si512(blk + P.hi + 64 * s);
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
        if constexpr (TYPE == Q5_K) {  // values 8v + j and 8v + 4 + j of the sub-block: fifth bits 2v and 2v + 1
          lo = _mm512_or_si512(lo, fifth_bit(hv, 2 * v));
          hi = _mm512_or_si512(hi, fifth_bit(hv, 2 * v + 1));
        }
        nibble_pair_dots<TB>(lo, hi, qa + b * QK + 8 * (VECS * s + v), K, dot);
      }
      for (int t = 0; t < TB; ++t) {
        __m512i d = dot[t];
        if constexpr (TYPE == Q6_K) d = _mm512_sub_epi32(d, _mm512_set1_epi32(b32[t * (K / 16) + b * 16 + s]));
        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(d, scv));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + P.d)));
    if constexpr (k_min(TYPE)) {
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
#elif defined(FORERUN_GGUF_AVX2)
  // Q5_K (and Q4_K / Q6_K with paired_halves off; tile_tokens sends them to their paired
  // tiles above by default). Two passes of 8 rows (half h of each 64-byte vector). A sub-block's products are summed
  // with its scale by madd (each row's scale in both 16-bit halves of its lane): the exact
  // int32 sum_s sc_s * dot_s the VNNI path gets with vpdpbusd and mullo; Q6_K's 32 x bsum
  // term taken off per sub-block after. The float operations are the VNNI path's.
  // A sub-block's weights are unpacked once into registers (2 x VECS vectors) and each token's
  // dot product runs over them in turn: one token's partial sums live at a time, so nothing
  // spills (unrolled over tokens, GCC kept every token's products on the stack). A token sums
  // SUM16_VECS vectors' maddubs results in int16 before the scale's madd: exact while a lane's
  // sum stays in int16 (activations in [-127, 127]: Q4_K 8 pairs of at most 2 x 15 x 127 =
  // 30480, Q5_K 4 x 2 x 31 x 127 = 31496, Q6_K 2 x 2 x 63 x 127 = 32004), the same int32 sums.
  const __m256i m4 = _mm256_set1_epi8(15), low16 = _mm256_set1_epi32(0xFFFF);
  constexpr int SUBS = k_min(TYPE) ? 8 : 16, VECS = 32 / SUBS;  // nibble vectors per sub-block
  constexpr int SUM16_VECS = TYPE == Q4_K ? 4 : TYPE == Q5_K ? 2 : 1;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[TB];
    for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * P.bytes;
      __m256i isum[TB];
      for (int t = 0; t < TB; ++t) isum[t] = _mm256_setzero_si256();
      for (int s = 0; s < SUBS; ++s) {
        if (h == 0) prefetch_ahead(blk, P.bytes, s, SUBS);
        const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + P.sc + 16 * s + 8 * h)));
        const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(sc32, low16), _mm256_slli_epi32(sc32, 16));
        __m256i hv = _mm256_setzero_si256();
        if constexpr (P.hi >= 0) hv = load32(blk + P.hi + 64 * s + 32 * h);
        __m256i lo[VECS], hi[VECS];
        for (int v = 0; v < VECS; ++v) {
          const __m256i x = load32(blk + 64 * (VECS * s + v) + 32 * h);
          lo[v] = _mm256_and_si256(x, m4);
          hi[v] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
          if constexpr (TYPE == Q6_K) q6k_top_bits(hv, v, lo[v], hi[v]);  // as the VNNI path
          if constexpr (TYPE == Q5_K) {
            lo[v] = _mm256_or_si256(lo[v], fifth_bit(hv, 2 * v));
            hi[v] = _mm256_or_si256(hi[v], fifth_bit(hv, 2 * v + 1));
          }
        }
        const int8_t* xs = qa + b * QK + 8 * VECS * s;
        for (int t = 0; t < TB; ++t) isum[t] = _mm256_add_epi32(isum[t], nibble_dot<VECS, SUM16_VECS>(lo, hi, xs + t * K, sc16));
        if constexpr (TYPE == Q6_K)
          for (int t = 0; t < TB; ++t)
            isum[t] = _mm256_sub_epi32(isum[t], _mm256_mullo_epi32(sc32, _mm256_set1_epi32(b32[t * (K / 16) + b * 16 + s])));
      }
      if constexpr (k_min(TYPE)) {
        kmin_block_end<TYPE, TB>(blk, h, b, nb, K, bp, da, isum, 1, acc);
      } else {
        const __m256 dv = half8(blk + P.d + 16 * h);
        for (int t = 0; t < TB; ++t)
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dv, _mm256_set1_ps(da[t * nb + b])), acc[t]);
      }
    }
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + LANES * t + 8 * h, acc[t]);
  }
#else
  scalar_dots<TYPE, TB>(w, nb, qa, K, da, bp, b32, out);
#endif
}

template <int64_t TYPE, int TB>
void tile_tokens(const uint8_t* w, int64_t nb, const Acts& a, int64_t t0, int64_t K, float* o, bool reference) {
  const int8_t* qa = a.qa.data() + t0 * K;
  const float* da = a.da.data() + t0 * nb;
  if constexpr (legacy(TYPE))
    (reference ? scalar_dots32<TYPE, TB> : tile_dots32<TYPE, TB>)(w, nb, qa, K, da, a.s32.data() + t0 * nb, o);
  else
    (reference ? scalar_dots<TYPE, TB> : tile_dots<TYPE, TB>)(w, nb, qa, K, da, a.bp.data() + t0 * (K / 64),
                                                              a.b32.data() + t0 * (K / 16), o);
}

#ifdef FORERUN_GGUF_AVX2
// Tokens t0 .. t0 + TB - 1 of one tile through its paired Q4_K / Q6_K tile.
template <int64_t TYPE, int TB>
void paired_tile(const uint8_t* w, int64_t nb, const Acts& a, int64_t t0, int64_t K, float* o) {
  const int8_t* qa = a.qa.data() + t0 * K;
  const float* da = a.da.data() + t0 * nb;
  if constexpr (TYPE == Q4_K) tile_dots_q4k_avx2<TB>(w, nb, qa, K, da, a.bp.data() + t0 * (K / 64), o);
  else tile_dots_q6k_avx2<TB>(w, nb, qa, K, da, a.b16p.data() + t0 * (K / 32), o);
}

// paired_tile<TYPE, n> for a run-time n in 1 .. PAIRED_MAX_TB.
template <int64_t TYPE, int... I>
void paired_tile_n(int n, const uint8_t* w, int64_t nb, const Acts& a, int64_t t0, int64_t K, float* o,
                   std::integer_sequence<int, I...>) {
  ((n == I + 1 ? paired_tile<TYPE, I + 1>(w, nb, a, t0, K, o) : void()), ...);
}
#endif

template <int64_t TYPE>
void tile_all_tokens(const uint8_t* w, int64_t nb, const Acts& a, int64_t N, int64_t K, float* out, bool reference) {
#ifdef FORERUN_GGUF_AVX2
  if constexpr (TYPE == Q4_K || TYPE == Q6_K)
    if (!reference && paired_halves.load(std::memory_order_relaxed)) {
      const int64_t step = paired_tokens.load(std::memory_order_relaxed);
      for (int64_t t0 = 0; t0 < N; t0 += step)
        paired_tile_n<TYPE>(static_cast<int>(std::min(step, N - t0)), w, nb, a, t0, K, out + LANES * t0,
                            std::make_integer_sequence<int, PAIRED_MAX_TB>{});
      return;
    }
#endif
  for (int64_t t0 = 0; t0 < N; t0 += MAX_TB) {
    float* o = out + LANES * t0;
    switch (std::min(MAX_TB, N - t0)) {
      case 1: tile_tokens<TYPE, 1>(w, nb, a, t0, K, o, reference); break;
      case 2: tile_tokens<TYPE, 2>(w, nb, a, t0, K, o, reference); break;
      case 3: tile_tokens<TYPE, 3>(w, nb, a, t0, K, o, reference); break;
      case 4: tile_tokens<TYPE, 4>(w, nb, a, t0, K, o, reference); break;
      case 5: tile_tokens<TYPE, 5>(w, nb, a, t0, K, o, reference); break;
      case 6: tile_tokens<TYPE, 6>(w, nb, a, t0, K, o, reference); break;
      case 7: tile_tokens<TYPE, 7>(w, nb, a, t0, K, o, reference); break;
      default: tile_tokens<TYPE, 8>(w, nb, a, t0, K, o, reference); break;
    }
  }
}

void check_part(const torch::Tensor& p, int64_t type, int64_t rows, int64_t K, const char* who) {
  const Packed P = packed_of(type);
  TORCH_CHECK(K % P.qk == 0, who, ": ", K, " inputs is not a whole number of blocks of ", P.qk);
  TORCH_CHECK(p.dtype() == torch::kUInt8 && p.is_contiguous() && p.dim() == 2 && p.size(0) * LANES >= rows &&
                  p.size(0) * LANES < rows + LANES && p.size(1) == K / P.qk * P.bytes,
              who, ": a packed part is not [ceil(rows / 16), ", K / P.qk * P.bytes, "] contiguous uint8");
}

}  // namespace

// w [rows, K / qk * bytes] (the file's blocks) -> [ceil(rows / 16), K / qk * tile-block bytes].
torch::Tensor gguf_pack(torch::Tensor w, int64_t type, int64_t K) {
  const Packed P = packed_of(type);
  TORCH_CHECK(K % P.qk == 0 && w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 &&
                  w.size(1) == K / P.qk * P.src_bytes,
              "gguf_pack: w is not [rows, ", K / P.qk * P.src_bytes, "] contiguous uint8");
  const int64_t rows = w.size(0), tiles = (rows + LANES - 1) / LANES, nb = K / P.qk;
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
  const int64_t n = idx.numel(), nb = K / P.qk, tiles = (n + LANES - 1) / LANES;
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
  const int64_t n = idx.numel(), nb = K / P.qk;
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
        gguf_dequant_values(type, P.qk, q, sc, mn, d, dmin, op + j * K + b * P.qk);
      }
  });
  return out;
}

// x [..., K] float32; parts [ceil(rows_i / 16), ...] packed of types[i] with rows[i] rows ->
// [..., sum rows_i] (+ bias [sum rows_i] when given), the parts' rows in order.
torch::Tensor gguf_packed_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                               std::vector<int64_t> rows, torch::Tensor bias, bool reference) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size() && parts.size() == rows.size(),
              "gguf_packed_rows: one type and one row count per part");
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K;
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
  Acts a32, a256;  // the activations per block of 32 and / or of 256, as the parts need them
  for (const int64_t t : types) {
    Acts& a = layout_of(t).qk == 32 ? a32 : a256;
    if (a.qk == 0) a = quantize(x.data_ptr<float>(), N, K, layout_of(t).qk);
  }
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
      const int64_t qk = layout_of(types[i]).qk, nb = K / qk;
      const Acts& a = qk == 32 ? a32 : a256;
      switch (types[i]) {
        case Q4_0: tile_all_tokens<Q4_0>(w, nb, a, N, K, acc.data(), reference); break;
        case Q4_1: tile_all_tokens<Q4_1>(w, nb, a, N, K, acc.data(), reference); break;
        case Q5_0: tile_all_tokens<Q5_0>(w, nb, a, N, K, acc.data(), reference); break;
        case Q5_1: tile_all_tokens<Q5_1>(w, nb, a, N, K, acc.data(), reference); break;
        case Q8_0: tile_all_tokens<Q8_0>(w, nb, a, N, K, acc.data(), reference); break;
        case Q4_K: tile_all_tokens<Q4_K>(w, nb, a, N, K, acc.data(), reference); break;
        case Q5_K: tile_all_tokens<Q5_K>(w, nb, a, N, K, acc.data(), reference); break;
        default: tile_all_tokens<Q6_K>(w, nb, a, N, K, acc.data(), reference); break;
      }
      const int64_t r0 = first[i] + tile * LANES, n = std::min(LANES, rows[i] - tile * LANES);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t l = 0; l < n; ++l) y[t * M + r0 + l] = bp ? acc[t * LANES + l] + bp[r0 + l] : acc[t * LANES + l];
    }
  });
  return out;
}

// The instructions the packed kernel computes with here: "avx512-vnni", "avx2" or "scalar"
// (the plain C++ definition, which the row kernel outruns).
std::string gguf_packed_isa() {
#if defined(FORERUN_GGUF_VNNI)
  return "avx512-vnni";
#elif defined(FORERUN_GGUF_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

void bind_gguf_packed_rows(pybind11::module& m) {
  m.def("set_gguf_paired_halves", [](bool on) { return paired_halves.exchange(on); },
        "Q4_K and Q6_K on AVX2: both 8-row halves per broadcast (true, the default) or one at a time; returns the previous");
  m.def("set_gguf_paired_tokens", [](int n) {
          TORCH_CHECK(n >= 1 && n <= PAIRED_MAX_TB, "set_gguf_paired_tokens: 1 to ", PAIRED_MAX_TB, " tokens a pass, got ", n);
          return paired_tokens.exchange(n);
        },
        "AVX2's paired Q4_K / Q6_K tiles: tokens per pass over a tile's weights (16, the default; 8 as before); returns the previous");
  m.def("gguf_pack", &gguf_pack, "GGUF rows rearranged 16 rows per tile (the same bits)");
  m.def("gguf_packed_select", &gguf_packed_select, "rows of a packed GGUF matrix, packed");
  m.def("gguf_packed_dequant", &gguf_packed_dequant, "rows of a packed GGUF matrix as float32 (ggml's values)");
  m.def("gguf_packed_rows", &gguf_packed_rows, "linear over packed GGUF tiles, batch-invariant (reference: the plain C++ definition)", ReleaseGil(),
        pybind11::arg("x"), pybind11::arg("parts"), pybind11::arg("types"), pybind11::arg("rows"), pybind11::arg("bias"),
        pybind11::arg("reference") = false);
  m.def("gguf_packed_isa", &gguf_packed_isa, "the packed GGUF kernel's instructions: avx512-vnni, avx2 or scalar");
}
