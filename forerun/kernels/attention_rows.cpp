// Chain attention for a few new tokens (the int8, int4, gguf and float32 CPU models): each
// (row, head, query) gets its own arithmetic, in the same order for any number of queries,
// so scoring k drafted tokens at once gives each the bits that scoring it alone would
// (SDPA's kernels tile queries together, so their bits depend on the batch). The queries of
// a KV head's query heads go over its keys together, a chunk at a time (attend_group_avx512),
// so K and V are read from memory once per KV head rather than once per query.
//
// attend_prefix: the attention alone. rope_write_attend: a whole attention layer between
// its q/k/v linear and its output linear (RoPE, the KV cache write, attention) in one call,
// which on a 24-28 layer model saves ~1-2 ms of small torch ops per forward.
//
// The cache is float32 or float16 (kv_cache_dtype="float16": half the bytes, lossy). A
// float16 cache is read through the same float32 code (CacheView below), so the arithmetic,
// the key order and the ISA paths are the float32 cache's: no float16 variant to test apart.
// It is laid out as rows [rows, Hkv, cap, D] (kv/cache.py) or as a paged pool [blocks, Hkv,
// block_size, D] read through a block table [rows, width] (kv/paged.py, the server's): slot s
// of a row is offset s % block_size of block table[row][s / block_size]. The paged pool is
// read in place (Keys below) where the plain C++ path runs, and copied a (row, KV head) at a
// time into per-thread scratch for the AVX512 path, whose chunks read keys as one run; either
// way every query sees the same values in the same order, so the bits are the rows layout's.
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_VNNI 1  // the same switch as int8_rows.cpp: one ISA level for every kernel
#endif
#ifdef __F16C__
#include <immintrin.h>
#endif
#if !defined(FORERUN_VNNI) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FORERUN_ATTEND_AVX2 1  // attend_group_avx2: attend_one_scalar's bits, 8 lanes at a time
#endif
#include <atomic>

// --- a float16 cache ---------------------------------------------------------------------
// Read: a (cache row, KV head)'s first n rows widened into per-thread float32 scratch before
// its queries attend. Exact (every float16 is a float32), so whichever conversion runs (F16C
// eight at a time, or c10's scalar one) the attention sees the same values.
// Write: each K / V element rounded to the nearest float16, ties to even (IEEE 754's default
// and what torch's float -> half copy does), so the rows rope_write_attend writes here and the
// rows the cache's own torch writes store (kv/cache.py, kv/paged.py) are the same bits.
static void widen_half(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i].x);
}

static void narrow_half(const float* src, int64_t n, at::Half* dst) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i].x = c10::detail::fp16_ieee_from_fp32_value(src[i]);
}

// Rows of one (cache row, KV head)'s K or V as the attention reads them: key j at
// base + j D (one run), or, in place in a paged pool, at blocks[j >> shift] + (j & mask) D.
struct Keys {
  const float* base = nullptr;
  const float* const* blocks = nullptr;
  int shift = 0;
  int64_t mask = 0, D = 0;
  const float* row(int64_t j) const { return base ? base + j * D : blocks[j >> shift] + (j & mask) * D; }
};

// Paged float32 pools are read in place by the plain C++ path (attend_one_scalar), whose runs
// of keys are at most 4 long (dots<4>, from a multiple of 4): blocks of a power of two >= 4
// slots keep each run in one block; and by the AVX2 path, which looks up each key's row once
// a chunk. The AVX512 path reads 64-key chunks as one run.
#ifdef FORERUN_VNNI
constexpr bool PAGED_IN_PLACE = false;
#else
constexpr bool PAGED_IN_PLACE = true;
#endif

// A layer's K or V cache, float32 or float16, as the attention reads and writes it: rows
// [rows, Hkv, cap, D], or a paged pool [blocks, Hkv, block_size, D] with its table [rows,
// width] (int64 block ids; cap = width x block_size). Offsets count elements.
struct CacheView {
  void* data;
  bool half;
  const int64_t* table = nullptr;  // paged: the block table; nullptr: the rows layout
  int64_t rows_n, Hkv, cap, D, bs = 0, width = 0, blocks_n = 0;

  CacheView(const torch::Tensor& t, const torch::Tensor& tables)
      : data(t.data_ptr()), half(t.scalar_type() == torch::kHalf), Hkv(t.size(1)), D(t.size(3)) {
    if (!tables.defined()) {
      rows_n = t.size(0);
      cap = t.size(2);
      return;
    }
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kLong && tables.is_contiguous(),
                "tables: int64 [rows, width], contiguous");
    table = tables.data_ptr<int64_t>();
    rows_n = tables.size(0);
    width = tables.size(1);
    bs = t.size(2);
    cap = width * bs;
    blocks_n = t.size(0);
  }

  // Checks that the table entries batch entry b reads (slots [0, need[b]) of row rp[b]) are
  // blocks of the pool.
  void check_reads(const int64_t* rp, int64_t B, const int64_t* need) const {
    if (!table) return;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < (need[b] + bs - 1) / bs; ++i) {
        const int64_t blk = table[rp[b] * width + i];
        TORCH_CHECK(blk >= 0 && blk < blocks_n, "a block table entry outside the pool");
      }
  }

  // The element offset of slot s of (cache row, KV head).
  int64_t at(int64_t row, int64_t kvh, int64_t s) const {
    if (!table) return ((row * Hkv + kvh) * cap + s) * D;
    return ((table[row * width + s / bs] * Hkv + kvh) * bs + s % bs) * D;
  }

  // Slots [0, n) of (row, kvh) as float32 rows: a float32 rows cache's own memory; a paged
  // float32 pool's blocks in place (PAGED_IN_PLACE, blocks of a power of two >= 4 slots, their
  // pointers in `ptrs`); else the slots widened or copied a block at a time into `scratch`
  // (grown to n D floats at most: bounded by the capacity).
  Keys rows(int64_t row, int64_t kvh, int64_t n, std::vector<float>& scratch, std::vector<const float*>& ptrs) const {
    Keys k;
    k.D = D;
    if (!half && !table) {
      k.base = static_cast<const float*>(data) + at(row, kvh, 0);
      return k;
    }
    if (!half && PAGED_IN_PLACE && bs >= 4 && (bs & (bs - 1)) == 0) {
      const int64_t nb = (n + bs - 1) / bs;
      if (static_cast<int64_t>(ptrs.size()) < nb) ptrs.resize(nb);
      for (int64_t i = 0; i < nb; ++i) ptrs[i] = static_cast<const float*>(data) + at(row, kvh, i * bs);
      k.blocks = ptrs.data();
      while ((int64_t{1} << k.shift) < bs) ++k.shift;
      k.mask = bs - 1;
      return k;
    }
    if (static_cast<int64_t>(scratch.size()) < n * D) scratch.resize(n * D);
    const int64_t run = table ? bs : n;  // slots stored one after another
    for (int64_t s = 0; s < n; s += run) {
      const int64_t m = std::min(run, n - s);
      if (half) widen_half(static_cast<const at::Half*>(data) + at(row, kvh, s), m * D, scratch.data() + s * D);
      else std::memcpy(scratch.data() + s * D, static_cast<const float*>(data) + at(row, kvh, s), m * D * sizeof(float));
    }
    k.base = scratch.data();
    return k;
  }

  // One row src [D] stored at `at` (rounded to float16 for a float16 cache).
  void store(int64_t at, const float* src) const {
    if (half) narrow_half(src, D, static_cast<at::Half*>(data) + at);
    else std::memcpy(static_cast<float*>(data) + at, src, D * sizeof(float));
  }
};

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into an integer
// power (exponent bits) and a degree-6 polynomial on [0, 1); ~2 ulp, branch-free so the
// compiler vectorises the loop that calls it. The same code runs for every query, which
// is the point: a query's result never depends on how many queries share the call.
// The polynomial's coefficients, highest degree first (p = c0, then p = p * f + c for the rest):
// the plain and AVX2 paths read them here, so the two cannot drift apart.
constexpr float LOG2E = 1.4426950408889634f;
constexpr float EXP2_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f,
                                2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * LOG2E;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = EXP2_POLY[0];
  for (int i = 1; i < 7; ++i) p = p * f + EXP2_POLY[i];
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Sum of 16 lanes in a fixed tree order.
static inline float lane_sum(float* lanes) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// R dot products <a, b_r> at once (independent chains hide the FMA latency). Each one's
// arithmetic is the same for any R, so a key's score never depends on its neighbours.
template <int R>
static inline void dots(const float* a, const float* b, int64_t D, float* out) {
  float lanes[R][16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 16; ++l) lanes[r][l] = std::fma(a[d + l], b[r * D + d + l], lanes[r][l]);
  for (; d < D; ++d)
    for (int r = 0; r < R; ++r) lanes[r][0] = std::fma(a[d], b[r * D + d], lanes[r][0]);
  for (int r = 0; r < R; ++r) out[r] = lane_sum(lanes[r]);
}

#ifdef FORERUN_VNNI
// Keys per pass of a group (below): 64 keys of K or V at D = 128 are 32 KB, which stay in
// L1 / L2 while every query of the group reads them, and the next chunk is asked for
// meanwhile (prefetch_part). Attention alone, the 1.5B's shapes (12 heads over 2 KV heads,
// D 128) at 4 queries, its K / V cold, one process, alternated: 1000 keys 363 -> 283 us a
// layer, 256 keys 103 -> 86 us, against 256-key chunks without prefetch or scores16.
constexpr int64_t KEY_CHUNK = 64;

// Softmax in place over p [0, L): the max, exp(p - max) (exp_nonpositive, 16 lanes at a
// time, the scalar tail after), and the sum of the exps, returned.
static float softmax_avx512(float* p, int64_t L) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(p + j));
  float m = _mm512_reduce_max_ps(mx);
  for (; j < L; ++j) m = std::max(m, p[j]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum_v = _mm512_setzero_ps();
  for (j = 0; j + 16 <= L; j += 16) {
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 y = _mm512_set1_ps(1.535336188319500e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.339887440266574e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618437357674640e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550332471162809e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402264791363012e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931472028550421e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
    const __m512 ex = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    _mm512_storeu_ps(p + j, ex);
    sum_v = _mm512_add_ps(sum_v, ex);
  }
  float sum = _mm512_reduce_add_ps(sum_v);
  for (; j < L; ++j) {
    p[j] = exp_nonpositive(p[j] - m);
    sum += p[j];
  }
  return sum;
}

// 16 vectors' lane sums, each in _mm512_reduce_add_ps's tree (lane l + l+8, then + 4, + 2,
// + 1), the 16 trees run side by side through shuffles (30 shuffles and 15 adds instead of
// 16 reductions of 7 dependent steps). The same adds on the same operands: every sum has the
// bits reduce_add gives it. Out lane i is a[i]'s sum.
static inline __m512 reduce16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // [a 2i: l + (l+8), l < 8 | a 2i+1: the same]
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // block k: a 4m + k, l + (l+4), l < 4
    s2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)  // block k: [a 8m + k, 8m + 4 + k: l + (l+2), l < 2]
    s3[m] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // f lane 4k + i is a[4i + k]
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), f);
}

// 16 keys' scores before the scale: per key r the FMA chain over D (qr . kr[r]) and its lane
// sum (reduce16). Out lane j is key j.
template <int V>
static inline __m512 scores16(const __m512* qr, const float* const* kr) {
  __m512 a[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_ps();
  for (int c = 0; c < V; ++c)
    for (int r = 0; r < 16; ++r) a[r] = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kr[r] + 16 * c), a[r]);
  return reduce16(a);
}

// Part `part` of `parts` of rows [r0, r1) of a [cap, D] K or V block into L2, spread over
// the group's queries so the requests do not go out in one burst.
static inline void prefetch_part(const float* base, int64_t r0, int64_t r1, int64_t D, int64_t part, int64_t parts) {
  if (r1 <= r0) return;
  const char* b = reinterpret_cast<const char*>(base + r0 * D);
  const int64_t lines = ((r1 - r0) * D * 4 + 63) / 64;
  for (int64_t c = lines * part / parts; c < lines * (part + 1) / parts; ++c) _mm_prefetch(b + 64 * c, _MM_HINT_T1);
}

// One query's scores for keys [j, j1) into pg[j ..]: 16 keys at a time through scores16, then
// 8, then 1 (key(j): the key's row).
template <int V, typename Key>
static inline void score_keys(const float* q, const float* kb, int64_t j, int64_t j1, Key key, float scale, float* pg) {
  constexpr int64_t D = 16 * V;
  __m512 qr[V];
  for (int c = 0; c < V; ++c) qr[c] = _mm512_loadu_ps(q + 16 * c);
  if constexpr (V <= 8)  // (16 accumulators and V query vectors in 32 registers)
    for (; j + 16 <= j1; j += 16) {
      const float* kr[16];
      for (int r = 0; r < 16; ++r) kr[r] = kb + key(j + r) * D;
      _mm512_storeu_ps(pg + j, _mm512_mul_ps(scores16<V>(qr, kr), _mm512_set1_ps(scale)));
    }
  for (; j + 8 <= j1; j += 8) {
    __m512 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
    const float* kr[8];
    for (int r = 0; r < 8; ++r) kr[r] = kb + key(j + r) * D;
    for (int c = 0; c < V; ++c)
      for (int r = 0; r < 8; ++r) a[r] = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kr[r] + 16 * c), a[r]);
    for (int r = 0; r < 8; ++r) pg[j + r] = _mm512_reduce_add_ps(a[r]) * scale;
  }
  for (; j < j1; ++j) {
    __m512 a0 = _mm512_setzero_ps();
    for (int c = 0; c < V; ++c) a0 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kb + key(j) * D + 16 * c), a0);
    pg[j] = _mm512_reduce_add_ps(a0) * scale;
  }
}

// One query's output chains over keys [j, j1) (j even): even keys into ag[0, D), odd keys
// into ag[D, 2D); a last key alone (odd L) goes into the even chain, as it is even.
template <int V, typename Key>
static inline void value_keys(const float* pg, const float* vb, int64_t j, int64_t j1, Key key, float* ag) {
  constexpr int64_t D = 16 * V;
  __m512 acc0[V], acc1[V];
  for (int c = 0; c < V; ++c) {
    acc0[c] = _mm512_loadu_ps(ag + 16 * c);
    acc1[c] = _mm512_loadu_ps(ag + D + 16 * c);
  }
  for (; j + 2 <= j1; j += 2) {
    const __m512 p0 = _mm512_set1_ps(pg[j]), p1 = _mm512_set1_ps(pg[j + 1]);
    const float *v0 = vb + key(j) * D, *v1 = vb + key(j + 1) * D;
    for (int c = 0; c < V; ++c) {
      acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc0[c]);
      acc1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), acc1[c]);
    }
  }
  if (j < j1) {
    const __m512 p0 = _mm512_set1_ps(pg[j]);
    for (int c = 0; c < V; ++c) acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + key(j) * D + 16 * c), acc0[c]);
  }
  for (int c = 0; c < V; ++c) {
    _mm512_storeu_ps(ag + 16 * c, acc0[c]);
    _mm512_storeu_ps(ag + D + 16 * c, acc1[c]);
  }
}

// QB queries that see the same keys, 4 keys at a time: each key vector is loaded once into a
// register for all QB queries (GCC would otherwise fold the load into every FMA and read the
// chunk from L2 once per query, the loop's limit). Per (query, key) the same FMA chain and
// reduce16 sum as score_keys, so the same bits. qs[i]: query i, ps[i]: its scores.
template <int V, int QB>
static inline void score_block(const float* const* qs, const float* kb, int64_t j, float scale, float* const* ps) {
  constexpr int64_t D = 16 * V;
  __m512 a[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_ps();
  for (int c = 0; c < V; ++c) {
    __m512 qr[QB];
    for (int i = 0; i < QB; ++i) qr[i] = _mm512_loadu_ps(qs[i] + 16 * c);
    for (int r = 0; r < 4; ++r) {
      __m512 k = _mm512_loadu_ps(kb + (j + r) * D + 16 * c);
      asm("" : "+v"(k));  // kept in a register: one load for the QB FMAs
      for (int i = 0; i < QB; ++i) a[4 * i + r] = _mm512_fmadd_ps(qr[i], k, a[4 * i + r]);
    }
  }
  alignas(64) float s[16];  // lane 4 i + r: query i, key j + r
  _mm512_store_ps(s, _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale)));
  for (int i = 0; i < QB; ++i) std::memcpy(ps[i] + j, s + 4 * i, 4 * sizeof(float));
}

// QB queries' output chains over the key pairs of [j, j1), two of the D / 16 vectors at a
// time (4 QB accumulators): each V vector loaded once for all QB queries. Per query and
// vector the same FMAs in the same order as value_keys.
template <int V, int QB>
static inline void value_block(const float* const* ps, const float* vb, int64_t j, int64_t j1, float* const* ag) {
  constexpr int64_t D = 16 * V;
  for (int c0 = 0; c0 < V; c0 += 2) {
    __m512 e[QB][2], o[QB][2];  // even / odd chains
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < 2; ++c) {
        e[i][c] = _mm512_loadu_ps(ag[i] + 16 * (c0 + c));
        o[i][c] = _mm512_loadu_ps(ag[i] + D + 16 * (c0 + c));
      }
    for (int64_t jj = j; jj + 2 <= j1; jj += 2) {
      const float *v0 = vb + jj * D + 16 * c0, *v1 = v0 + D;
      __m512 a0 = _mm512_loadu_ps(v0), a1 = _mm512_loadu_ps(v0 + 16);
      __m512 b0 = _mm512_loadu_ps(v1), b1 = _mm512_loadu_ps(v1 + 16);
      asm("" : "+v"(a0), "+v"(a1), "+v"(b0), "+v"(b1));
      for (int i = 0; i < QB; ++i) {
        const __m512 p0 = _mm512_set1_ps(ps[i][jj]), p1 = _mm512_set1_ps(ps[i][jj + 1]);
        e[i][0] = _mm512_fmadd_ps(p0, a0, e[i][0]);
        e[i][1] = _mm512_fmadd_ps(p0, a1, e[i][1]);
        o[i][0] = _mm512_fmadd_ps(p1, b0, o[i][0]);
        o[i][1] = _mm512_fmadd_ps(p1, b1, o[i][1]);
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < 2; ++c) {
        _mm512_storeu_ps(ag[i] + 16 * (c0 + c), e[i][c]);
        _mm512_storeu_ps(ag[i] + D + 16 * (c0 + c), o[i][c]);
      }
  }
}

// Keys [j0, j0 + KEY_CHUNK) for the QB queries qi[0 ..] (pass 0: scores, pass 1: output
// chains): the keys all of them see through score_block / value_block, then each query's own
// remaining keys through score_keys / value_keys. QB 1, a tree (IDX) or an odd V: per query.
template <int V, bool IDX, int QB>
static void chunk_for_block(int pass, const int64_t* qi, const float* const* qv, const int64_t* L, const float* kb,
                            const float* vb, float scale, float* p, int64_t stride, float* acc,
                            const int32_t* const* idx, int64_t j0) {
  constexpr int64_t D = 16 * V;
  int64_t j = j0, common = j0 + KEY_CHUNK;
  for (int i = 0; i < QB; ++i) common = std::min(common, L[qi[i]]);
  if constexpr (!IDX && V % 2 == 0 && QB > 1) {
    const float* qs[QB];
    float *ps[QB], *ag[QB];
    for (int i = 0; i < QB; ++i) {
      qs[i] = qv[qi[i]];
      ps[i] = p + qi[i] * stride;
      ag[i] = acc + qi[i] * 2 * D;
    }
    if (pass == 0)
      for (; j + 4 <= common; j += 4) score_block<V, QB>(qs, kb, j, scale, ps);
    else if (common - j0 >= 2) {
      j = j0 + (common - j0) / 2 * 2;
      value_block<V, QB>(ps, vb, j0, j, ag);
    }
  }
  for (int i = 0; i < QB; ++i) {
    const int64_t g = qi[i], j1 = std::min(j0 + KEY_CHUNK, L[g]);
    if (j >= j1) continue;
    auto key = [&](int64_t r) -> int64_t { return IDX ? idx[g][r] : r; };
    if (pass == 0) score_keys<V>(qv[g], kb, j, j1, key, scale, p + g * stride);
    else value_keys<V>(p + g * stride, vb, j, j1, key, acc + g * 2 * D);
  }
}

// The attention of G queries that share one KV head (a GQA group's heads, each with its T
// queries), AVX512, D = 16 V. Query g sees keys [0, L[g]) (or, IDX, the keys at rows
// idx[g][0 .. L[g])). Keys are taken KEY_CHUNK at a time and every query of the group goes
// over a chunk before the next one is read, so K and V come from memory once per group, not
// once per query (at 2048 keys the 1.5B's K and V are 2 MB a KV head). The queries go in
// blocks of up to 4 with the fewest keys first, so a block's queries mostly see the same keys
// (a chain's T tokens over its heads: the heads of one token see the same keys), and a key
// vector read from the chunk serves the whole block. Each query's arithmetic is the
// one-query sequence whatever G, its block and wherever the chunks fall:
//   score j: one FMA chain over D, one horizontal sum in reduce_add's tree, times scale;
//   softmax over all its scores (softmax_avx512);
//   out: two FMA chains over its keys (even / odd; the last odd key into the even one), the
//        chains kept in acc between chunks, joined at the end, times 1 / sum.
// The 1.5B's shapes (6 heads a KV head, D 128), one thread, keys in cache, against one query
// at a time: 8 queries over 2048 keys 1110 -> 651 us, 5 queries 601 -> 405, 1 query 144 -> 105;
// the 0.5B's D 64 (7 heads a KV head) 0.99-1.2x, its chunks were not held up by L2.
// p: G x stride floats, acc: G x 2 D floats, sums: G floats (scratch).
template <int V, bool IDX>
static void attend_group_avx512(int64_t G, const float* const* qv, const int64_t* L, const float* kb, const float* vb,
                                float scale, float* p, int64_t stride, float* acc, float* sums, float* const* o,
                                const int32_t* const* idx) {
  constexpr int64_t D = 16 * V;
  int64_t Lmax = 0;
  for (int64_t g = 0; g < G; ++g) Lmax = std::max(Lmax, L[g]);
  std::vector<int64_t> order(G);  // the queries, fewest keys first, in blocks of at most 4
  for (int64_t g = 0; g < G; ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return L[a] < L[b]; });
  const int64_t blocks = (G + 3) / 4;
  auto chunk = [&](int pass, int64_t b, int64_t j0) {
    const int64_t* qi = order.data() + G * b / blocks;
    switch (G * (b + 1) / blocks - G * b / blocks) {
      case 4: return chunk_for_block<V, IDX, 4>(pass, qi, qv, L, kb, vb, scale, p, stride, acc, idx, j0);
      case 3: return chunk_for_block<V, IDX, 3>(pass, qi, qv, L, kb, vb, scale, p, stride, acc, idx, j0);
      case 2: return chunk_for_block<V, IDX, 2>(pass, qi, qv, L, kb, vb, scale, p, stride, acc, idx, j0);
      default: return chunk_for_block<V, IDX, 1>(pass, qi, qv, L, kb, vb, scale, p, stride, acc, idx, j0);
    }
  };
  for (int64_t j0 = 0; j0 < Lmax; j0 += KEY_CHUNK)
    for (int64_t b = 0; b < blocks; ++b) {
      if constexpr (!IDX) {  // the next chunk of K, or after the last one the first of V
        if (j0 + KEY_CHUNK < Lmax) prefetch_part(kb, j0 + KEY_CHUNK, std::min(j0 + 2 * KEY_CHUNK, Lmax), D, b, blocks);
        else prefetch_part(vb, 0, std::min(KEY_CHUNK, Lmax), D, b, blocks);
      }
      chunk(0, b, j0);
    }
  for (int64_t g = 0; g < G; ++g) {
    sums[g] = softmax_avx512(p + g * stride, L[g]);
    std::fill(acc + g * 2 * D, acc + (g + 1) * 2 * D, 0.f);
  }
  for (int64_t j0 = 0; j0 < Lmax; j0 += KEY_CHUNK)  // (KEY_CHUNK is even: the pairs stay pairs)
    for (int64_t b = 0; b < blocks; ++b) {
      if constexpr (!IDX) prefetch_part(vb, j0 + KEY_CHUNK, std::min(j0 + 2 * KEY_CHUNK, Lmax), D, b, blocks);
      chunk(1, b, j0);
    }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g]);
    const float* ag = acc + g * 2 * D;
    for (int c = 0; c < V; ++c)
      _mm512_storeu_ps(o[g] + 16 * c,
                       _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(ag + 16 * c), _mm512_loadu_ps(ag + D + 16 * c)), inv));
  }
}

// attend_group_avx512 for D = 16 V, V = 1 .. 16; false for other head sizes.
template <bool IDX, int V = 1>
static bool attend_group_d(int64_t D, int64_t G, const float* const* qv, const int64_t* L, const float* kb,
                           const float* vb, float scale, float* p, int64_t stride, float* acc, float* sums,
                           float* const* o, const int32_t* const* idx) {
  if constexpr (V > 16) {
    return false;
  } else {
    if (D != 16 * V) return attend_group_d<IDX, V + 1>(D, G, qv, L, kb, vb, scale, p, stride, acc, sums, o, idx);
    attend_group_avx512<V, IDX>(G, qv, L, kb, vb, scale, p, stride, acc, sums, o, idx);
    return true;
  }
}
#endif

// The same attention in plain C++ (any D; every ISA). p [L], acc0 / acc1 [D]: scratch;
// idx: the rows of the L keys, as in attend_group_avx512 (nullptr: keys 0 .. L). kb, vb: the
// keys' and values' rows (in one run, or in place in a paged pool's blocks: the same values).
static void attend_one_scalar(const float* qv, const Keys& kb, const Keys& vb, int64_t L, int64_t D, float scale,
                              float* p, float* acc0, float* acc1, float* o, const int32_t* idx) {
  auto key = [&](int64_t j) -> int64_t { return idx ? idx[j] : j; };
  int64_t j = 0;
  if (idx)  // (dots<R> gives each key the same arithmetic for any R)
    for (; j < L; ++j) dots<1>(qv, kb.row(key(j)), D, p + j);
  for (; j + 4 <= L; j += 4) dots<4>(qv, kb.row(j), D, p + j);  // (keys j .. j + 3 are one run)
  for (; j < L; ++j) dots<1>(qv, kb.row(j), D, p + j);
  float lanes[16];  // 16-lane max, then 16-lane sum, each joined in a fixed order
  for (int l = 0; l < 16; ++l) lanes[l] = -INFINITY;
  for (j = 0; j < L; ++j) p[j] *= scale;
  for (j = 0; j + 16 <= L; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], p[j + l]);
  for (int l = 0; j + l < L; ++l) lanes[l] = std::max(lanes[l], p[j + l]);
  float m = lanes[0];
  for (int l = 1; l < 16; ++l) m = std::max(m, lanes[l]);
  for (j = 0; j < L; ++j) p[j] = exp_nonpositive(p[j] - m);
  for (int l = 0; l < 16; ++l) lanes[l] = 0.f;
  for (j = 0; j + 16 <= L; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += p[j + l];
  for (int l = 0; j + l < L; ++l) lanes[l] += p[j + l];
  const float sum = lane_sum(lanes);
  for (int64_t d = 0; d < D; ++d) acc0[d] = acc1[d] = 0.f;
  for (j = 0; j + 2 <= L; j += 2) {  // two chains (even / odd keys), joined at the end
    const float p0 = p[j], p1 = p[j + 1];
    const float *v0 = vb.row(key(j)), *v1 = vb.row(key(j + 1));
    for (int64_t d = 0; d < D; ++d) {
      acc0[d] = std::fma(p0, v0[d], acc0[d]);
      acc1[d] = std::fma(p1, v1[d], acc1[d]);
    }
  }
  if (j < L) {
    const float* v0 = vb.row(key(j));
    for (int64_t d = 0; d < D; ++d) acc0[d] = std::fma(p[j], v0[d], acc0[d]);
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) o[d] = (acc0[d] + acc1[d]) * inv;
}

#ifdef FORERUN_ATTEND_AVX2
// attend_one_scalar's operations, 8 lanes at a time, for D a multiple of 32: the same bits.
// Its 16 lanes (dots, the max, the sum) are two vectors, lo = lanes 0-7 and hi = 8-15, summed
// in lane_sum's tree (l + (l+8), then + 4, + 2, + 1); exp_nonpositive's multiplies and adds
// stay separate (the build contracts nothing); the output's two chains are 4 vectors each in
// registers over a chunk of keys, 32 values of D at a time, where the plain loop loads and
// stores them for every key; and a group's queries go over K and V a chunk at a time.
static inline float lane_sum8(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// lane_sum8 of four keys' (lo, hi) at once, its adds on the same operands in the same tree
// (s8 = lo + hi; then lanes l + (l+4), l + (l+2), l + (l+1)) with the four trees side by side
// in shuffled vectors: out[r] gets lane_sum8(lo[r], hi[r])'s bits, in 23 vector operations
// where four lane_sum8 take 28 and four scalar stores.
static inline void lane_sum8x4(const __m256* lo, const __m256* hi, float* out) {
  __m256 s8[4];
  for (int r = 0; r < 4; ++r) s8[r] = _mm256_add_ps(lo[r], hi[r]);
  // [s4 of key 0 | s4 of key 1] and [key 2 | key 3]: low 4 lanes + high 4 lanes of each s8
  const __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(s8[0], s8[1], 0x20), _mm256_permute2f128_ps(s8[0], s8[1], 0x31));
  const __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(s8[2], s8[3], 0x20), _mm256_permute2f128_ps(s8[2], s8[3], 0x31));
  // per 128-bit half, s4[l] + s4[l+2]: [s2 key 0, s2 key 2 | s2 key 1, s2 key 3]
  const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  // s2[0] + s2[1]: [key 0, key 2, ., . | key 1, key 3, ., .]
  const __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c, c, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(c, c, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1)));
}

// R keys' scores for one query: per key the two 8-lane halves of attend_one_scalar's 16-lane
// FMA chain over D, then its lane sum.
template <int R>
static inline void dots_avx2(const float* a, const float* const* b, int64_t D, float* out) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 a0 = _mm256_loadu_ps(a + d), a1 = _mm256_loadu_ps(a + d + 8);
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(b[r] + d), lo[r]);
      hi[r] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(b[r] + d + 8), hi[r]);
    }
  }
  if constexpr (R == 4) lane_sum8x4(lo, hi, out);
  else
    for (int r = 0; r < R; ++r) out[r] = lane_sum8(lo[r], hi[r]);
}

static inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2E));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(EXP2_POLY[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// A query's scores [0, L) after the dots (p): times scale, the max in 16 lanes, exp(p - max)
// and the sum of the exps in 16 lanes, as attend_one_scalar; returns the sum.
static float softmax_avx2(float* p, int64_t L, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 mlo = _mm256_set1_ps(-INFINITY), mhi = mlo;
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), vs));
  for (; j < L; ++j) p[j] *= scale;
  for (j = 0; j + 16 <= L; j += 16) {
    mlo = _mm256_max_ps(mlo, _mm256_loadu_ps(p + j));
    mhi = _mm256_max_ps(mhi, _mm256_loadu_ps(p + j + 8));
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, mlo);
  _mm256_store_ps(lanes + 8, mhi);
  for (int l = 0; j + l < L; ++l) lanes[l] = std::max(lanes[l], p[j + l]);
  float m = lanes[0];
  for (int l = 1; l < 16; ++l) m = std::max(m, lanes[l]);
  const __m256 vm = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= L; j += 8) _mm256_storeu_ps(p + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm)));
  for (; j < L; ++j) p[j] = exp_nonpositive(p[j] - m);
  __m256 slo = _mm256_setzero_ps(), shi = slo;
  for (j = 0; j + 16 <= L; j += 16) {
    slo = _mm256_add_ps(slo, _mm256_loadu_ps(p + j));
    shi = _mm256_add_ps(shi, _mm256_loadu_ps(p + j + 8));
  }
  _mm256_store_ps(lanes, slo);
  _mm256_store_ps(lanes + 8, shi);
  for (int l = 0; j + l < L; ++l) lanes[l] += p[j + l];
  return lane_sum(lanes);
}

// Keys per pass of a group: 32 keys of K or V at D 128 are 16 KB, which stay in L1 while every
// query of the group reads them (one query at a time over all its keys read K and V from L3
// once per query).
constexpr int64_t KEY_CHUNK_AVX2 = 32;

// The queries of a group over the same K / V, a chunk of keys at a time: per query the scores
// of attend_one_scalar (dots of 4 keys, then 1: the same arithmetic per key), its softmax, and
// its two output chains (even / odd keys; an odd last key into the even one) continued chunk
// after chunk in acc, so each query's arithmetic is the definition's whatever G and the chunks.
// p: G x stride, acc: G x 2 D, sums: G (scratch); D a multiple of 32.
template <bool IDX>
static void attend_group_avx2(int64_t G, const float* const* qv, const int64_t* L, const Keys& kb, const Keys& vb,
                              int64_t D, float scale, float* p, int64_t stride, float* acc, float* sums,
                              float* const* o, const int32_t* const* idx) {
  int64_t Lmax = 0;
  for (int64_t g = 0; g < G; ++g) Lmax = std::max(Lmax, L[g]);
  const float* kr[KEY_CHUNK_AVX2];  // the chunk's rows of K (then V): once a chunk, or a query's own (a tree)
  const float* vr[KEY_CHUNK_AVX2];
  auto chunk_rows = [&](const Keys& keys, int64_t g, int64_t j0, int64_t j1, const float** rows) {
    for (int64_t j = j0; j < j1; ++j) rows[j - j0] = keys.row(IDX ? idx[g][j] : j);
  };
  for (int64_t j0 = 0; j0 < Lmax; j0 += KEY_CHUNK_AVX2) {
    if (!IDX) chunk_rows(kb, 0, j0, std::min(j0 + KEY_CHUNK_AVX2, Lmax), kr);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j1 = std::min(j0 + KEY_CHUNK_AVX2, L[g]);
      if (IDX) chunk_rows(kb, g, j0, j1, kr);
      float* pg = p + g * stride;
      int64_t j = j0;
      for (; j + 4 <= j1; j += 4) dots_avx2<4>(qv[g], kr + (j - j0), D, pg + j);
      for (; j < j1; ++j) dots_avx2<1>(qv[g], kr + (j - j0), D, pg + j);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    sums[g] = softmax_avx2(p + g * stride, L[g], scale);
    std::fill(acc + g * 2 * D, acc + (g + 1) * 2 * D, 0.f);
  }
  for (int64_t j0 = 0; j0 < Lmax; j0 += KEY_CHUNK_AVX2) {  // (the chunk is even: pairs stay pairs)
    if (!IDX) chunk_rows(vb, 0, j0, std::min(j0 + KEY_CHUNK_AVX2, Lmax), vr);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j1 = std::min(j0 + KEY_CHUNK_AVX2, L[g]);
      if (j0 >= j1) continue;
      if (IDX) chunk_rows(vb, g, j0, j1, vr);
      const float* pg = p + g * stride;
      float *ae = acc + g * 2 * D, *ao = ae + D;
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m256 e[4], od[4];
        for (int c = 0; c < 4; ++c) {
          e[c] = _mm256_loadu_ps(ae + d0 + 8 * c);
          od[c] = _mm256_loadu_ps(ao + d0 + 8 * c);
        }
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
          const __m256 p0 = _mm256_set1_ps(pg[j]), p1 = _mm256_set1_ps(pg[j + 1]);
          const float *v0 = vr[j - j0] + d0, *v1 = vr[j - j0 + 1] + d0;
          for (int c = 0; c < 4; ++c) {
            e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), e[c]);
            od[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * c), od[c]);
          }
        }
        if (j < j1) {  // the query's last key, alone
          const __m256 p0 = _mm256_set1_ps(pg[j]);
          const float* v0 = vr[j - j0] + d0;
          for (int c = 0; c < 4; ++c) e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), e[c]);
        }
        for (int c = 0; c < 4; ++c) {
          _mm256_storeu_ps(ae + d0 + 8 * c, e[c]);
          _mm256_storeu_ps(ao + d0 + 8 * c, od[c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 vi = _mm256_set1_ps(1.f / sums[g]);
    const float *ae = acc + g * 2 * D, *ao = ae + D;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(o[g] + d, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(ae + d), _mm256_loadu_ps(ao + d)), vi));
  }
}
#endif

// Test switch: true sends every query through attend_one_scalar, the definition the SIMD
// paths without AVX512 reproduce bit for bit (tests/test_attention_simd.py compares them).
static std::atomic<bool> attention_reference{false};

bool set_attention_reference(bool on) { return attention_reference.exchange(on); }

// The queries of one GQA group (or part of one), all reading the same KV head: query g's
// vector q[g], its key count L[g] (and, for a token tree, the keys' rows idx[g]), output o[g].
struct Group {
  std::vector<const float*> q;
  std::vector<int64_t> L;
  std::vector<float*> o;
  std::vector<const int32_t*> idx;
  void add(const float* qv, int64_t n, float* out, const int32_t* rows = nullptr) {
    q.push_back(qv);
    L.push_back(n);
    o.push_back(out);
    idx.push_back(rows);
  }
};

// Per-thread scratch: scores (a row per query, as long as the longest query's keys), the
// output's two chains and the softmax sums (one per query). One per thread and caller (a
// thread_local in for_each_group's body), kept between calls and only ever grown: a fresh
// one per layer was zero-filled to G rows of the cache's capacity each time (the 1.5B at 8
// queries over a 2048-key cache: 22 MB of memset a forward).
struct Scratch {
  std::vector<float> p, acc, sums;
  std::vector<float> k, v;  // a float16 cache's rows widened, or a paged pool's copied (CacheView::rows)
  std::vector<const float*> kb, vb;  // a paged pool's block pointers, read in place (CacheView::rows)
  static float* at_least(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

// A group's attention over kb, vb: AVX512 where D is a multiple of 16 up to 256 (its keys
// in one run: CacheView::rows copies a paged pool's there), else query by query in plain C++.
template <bool IDX>
static void attend_group(const Group& grp, const Keys& kb, const Keys& vb, int64_t D, float scale, Scratch& s) {
  const int64_t G = static_cast<int64_t>(grp.q.size());
  const int64_t stride = (*std::max_element(grp.L.begin(), grp.L.end()) + 15) / 16 * 16;  // (L <= cap)
  float *p = Scratch::at_least(s.p, G * stride), *acc = Scratch::at_least(s.acc, G * 2 * D);
  float* sums = Scratch::at_least(s.sums, G);
#ifdef FORERUN_VNNI
  TORCH_CHECK(kb.base && vb.base, "the AVX512 attention reads keys in one run");
  if (attend_group_d<IDX>(D, G, grp.q.data(), grp.L.data(), kb.base, vb.base, scale, p, stride, acc, sums,
                          grp.o.data(), grp.idx.data()))
    return;
#endif
#ifdef FORERUN_ATTEND_AVX2
  if (D % 32 == 0 && !attention_reference.load(std::memory_order_relaxed)) {
    attend_group_avx2<IDX>(G, grp.q.data(), grp.L.data(), kb, vb, D, scale, p, stride, acc, sums, grp.o.data(),
                           grp.idx.data());
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    attend_one_scalar(grp.q[g], kb, vb, grp.L[g], D, scale, p, acc, acc + D, grp.o[g], IDX ? grp.idx[g] : nullptr);
}

// The layer's K and V cache (rows, or a paged pool with `tables`), checked, as CacheViews.
static std::pair<CacheView, CacheView> cache_views(const torch::Tensor& k, const torch::Tensor& v,
                                                   const std::optional<torch::Tensor>& tables) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
              k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kHalf),
              "k, v: float32 or float16 [rows, Hkv, cap, D] (or [blocks, Hkv, block_size, D] with tables), one dtype");
  const torch::Tensor t = tables.has_value() ? *tables : torch::Tensor();
  return {CacheView(k, t), CacheView(v, t)};
}

// rows [B] as contiguous int64, each checked to be a row of the cache.
static torch::Tensor cache_rows(const torch::Tensor& rows, int64_t B, const CacheView& k) {
  auto r = rows.to(torch::kLong).contiguous();
  TORCH_CHECK(r.numel() == B, "rows [B]");
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < k.rows_n, "cache row out of range");
  return r;
}

// body(b, h0, h1, kb, vb, scratch) for every batch entry b and run of query heads
// [h0, h1) sharing one KV head, in parallel; kb / vb read the K / V of b's cache row (rp[b])
// for that KV head, as float32 rows [0, need[b]) at least (the slots b's queries read). A KV
// head's query heads form one run, or several when there are fewer (b, KV head) pairs than
// threads.
template <class Body>
static void for_each_group(int64_t B, int64_t H, int64_t Hkv, int64_t D, const int64_t* rp, const CacheView& k,
                           const CacheView& v, const int64_t* need, Body body) {
  const int64_t group = H / Hkv, pairs = B * Hkv;
  const int64_t parts = std::min<int64_t>(group, (at::get_num_threads() + pairs - 1) / pairs);
  const int64_t per = (group + parts - 1) / parts;
  at::parallel_for(0, pairs * parts, 1, [&](int64_t u0, int64_t u1) {
    thread_local Scratch s;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (Hkv * parts), kvh = u / parts % Hkv, h0 = kvh * group + u % parts * per;
      const int64_t h1 = std::min(h0 + per, (kvh + 1) * group);
      if (h0 >= h1) continue;
      body(b, h0, h1, k.rows(rp[b], kvh, need[b], s.k, s.kb), v.rows(rp[b], kvh, need[b], s.v, s.vb), s);
    }
  });
}

// Attention where query t of batch entry b sees keys [0, limits[b, t]) of its cache row (a
// chain: every query sees a prefix). q [B, H, T, D]; k/v: the layer's whole cache, float32
// or float16 [rows, Hkv, capacity, D] (or a paged pool [blocks, Hkv, block_size, D] and its
// tables [rows, width]); rows [B]; limits [B, T] -> [B, H, T, D].
torch::Tensor attend_prefix(torch::Tensor q_in, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                            torch::Tensor limits, double scale_d, std::optional<torch::Tensor> tables) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == torch::kFloat32, "q: float32 [B, H, T, D]");
  const auto views = cache_views(k, v, tables);
  const CacheView &kc = views.first, &vc = views.second;
  const auto q = q_in.contiguous();
  const auto lim = limits.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = kc.Hkv, cap = kc.cap;
  TORCH_CHECK(kc.D == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(lim.size(0) == B && lim.size(1) == T, "limits [B, T]");
  const auto row_idx = cache_rows(rows, B, kc);
  const float scale = static_cast<float>(scale_d);
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* lp = lim.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "a query must see between 1 and capacity keys");
  std::vector<int64_t> need(B, 0);  // the keys b's queries see: [0, max limit)
  for (int64_t i = 0; i < B * T; ++i) need[i / T] = std::max(need[i / T], lp[i]);
  kc.check_reads(row_idx.data_ptr<int64_t>(), B, need.data());
  for_each_group(B, H, Hkv, D, row_idx.data_ptr<int64_t>(), kc, vc, need.data(),
                 [&](int64_t b, int64_t h0, int64_t h1, const Keys& kb, const Keys& vb, Scratch& s) {
                   Group grp;
                   for (int64_t h = h0; h < h1; ++h)
                     for (int64_t t = 0; t < T; ++t)
                       grp.add(qp + ((b * H + h) * T + t) * D, lp[b * T + t], op + ((b * H + h) * T + t) * D);
                   attend_group<false>(grp, kb, vb, D, scale, s);
                 });
  return out;
}

// RoPE in the rotate-half layout, element for element the arithmetic of models/rope.py's
// apply_rope (x * cos + rotate_half(x) * sin: two products, one sum; no FMA, see the build
// flags), so this path and the torch one give the same bits.
static inline void rotate_half(const float* x, const float* c, const float* s, int64_t D, float* o) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < D; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
}

// A chain batch's attention layer between its q/k/v linear and its output linear:
//   1. rotate q and k of each new token (RoPE), write k and v at its slot of its cache row;
//   2. query t of batch entry b attends over slots [0, slots[b, t]] of its row.
// qkv [B, T, (H + 2 Hkv) D] (the q/k/v linear's output); cos, sin [B, 1, T, D];
// k, v: the layer's cache [rows, Hkv, cap, D] (or a paged pool and its tables, as
// attend_prefix); rows [B]; slots [B, T] -> [B, T, H D], the layout the output linear reads
// (no transpose copy).
torch::Tensor rope_write_attend(torch::Tensor qkv_in, torch::Tensor cos_in, torch::Tensor sin_in, torch::Tensor k,
                                torch::Tensor v, torch::Tensor rows, torch::Tensor slots, int64_t heads,
                                int64_t kv_heads, double scale_d, std::optional<torch::Tensor> tables) {
  const auto views = cache_views(k, v, tables);
  const CacheView &kc = views.first, &vc = views.second;
  const int64_t H = heads, Hkv = kv_heads, D = kc.D, cap = kc.cap;
  TORCH_CHECK(qkv_in.dim() == 3 && qkv_in.scalar_type() == torch::kFloat32 && qkv_in.size(2) == (H + 2 * Hkv) * D,
              "qkv: float32 [B, T, (heads + 2 kv_heads) head_dim]");
  TORCH_CHECK(Hkv == kc.Hkv && H % Hkv == 0 && D % 2 == 0, "head shapes");
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1), W = qkv_in.size(2);
  const auto qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.numel() == B * T * D && sin.numel() == B * T * D, "cos, sin: float32 [B, 1, T, head_dim]");
  const auto row_idx = cache_rows(rows, B, kc);
  const auto slot = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(slot.numel() == B * T, "slots [B, T]");
  const int64_t *rp = row_idx.data_ptr<int64_t>(), *sp = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < cap, "slot outside the cache");
  std::vector<int64_t> need(B, 0);  // the keys b's queries see: [0, last slot + 1) (its writes among them)
  for (int64_t i = 0; i < B * T; ++i) need[i / T] = std::max(need[i / T], sp[i] + 1);
  kc.check_reads(rp, B, need.data());
  auto q = torch::empty({B, H, T, D}, qkv.options());
  auto out = torch::empty({B, T, H * D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> kr(D);  // a rotated key row before its store
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / T, t = i % T;
      const float *x = xp + i * W, *c = cp + i * D, *s = snp + i * D;
      for (int64_t h = 0; h < H; ++h) rotate_half(x + h * D, c, s, D, qp + ((b * H + h) * T + t) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = kc.at(rp[b], h, sp[i]);
        rotate_half(x + (H + h) * D, c, s, D, kr.data());
        kc.store(at, kr.data());
        vc.store(at, x + (H + Hkv + h) * D);
      }
    }
  });
  const float scale = static_cast<float>(scale_d);
  for_each_group(B, H, Hkv, D, rp, kc, vc, need.data(),
                 [&](int64_t b, int64_t h0, int64_t h1, const Keys& kb, const Keys& vb, Scratch& s) {
                   Group grp;
                   for (int64_t h = h0; h < h1; ++h)
                     for (int64_t t = 0; t < T; ++t)
                       grp.add(qp + ((b * H + h) * T + t) * D, sp[b * T + t] + 1, op + (b * T + t) * H * D + h * D);
                   attend_group<false>(grp, kb, vb, D, scale, s);
                 });
  return out;
}

// Attention under an explicit mask (token trees): query t of batch entry b sees the slots
// j < S of its cache row where mask[b, t, j], in slot order, through the same per-query
// code as a chain. A tree node's visible keys are the prefix and its ancestors, whose K/V
// carry the bits its chain would have given them (same tokens, same RoPE positions), so
// the node's output equals the chain's: int8 tree verification keeps plain decoding's bits.
// q [B, H, T, D]; k/v [rows, Hkv, cap, D] (or a paged pool and its tables, as attend_prefix);
// rows [B]; mask [B, T, S] bool -> [B, H, T, D].
torch::Tensor attend_masked(torch::Tensor q_in, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                            torch::Tensor mask_in, double scale_d, std::optional<torch::Tensor> tables) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == torch::kFloat32, "q: float32 [B, H, T, D]");
  const auto views = cache_views(k, v, tables);
  const CacheView &kc = views.first, &vc = views.second;
  const auto q = q_in.contiguous();
  const auto mask = mask_in.to(torch::kBool).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = kc.Hkv, cap = kc.cap;
  TORCH_CHECK(kc.D == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T && mask.size(2) <= cap,
              "mask [B, T, S] with S <= capacity");
  const auto row_idx = cache_rows(rows, B, kc);
  const int64_t S = mask.size(2);
  const bool* mp = mask.data_ptr<bool>();
  std::vector<std::vector<int32_t>> seen(B * T);  // visible slots per query, in slot order
  std::vector<int64_t> need(B, 0);  // the slots b's queries see lie in [0, last + 1)
  for (int64_t i = 0; i < B * T; ++i) {
    for (int64_t j = 0; j < S; ++j)
      if (mp[i * S + j]) seen[i].push_back(static_cast<int32_t>(j));
    TORCH_CHECK(!seen[i].empty(), "a query must see at least one key");
    need[i / T] = std::max<int64_t>(need[i / T], seen[i].back() + 1);
  }
  kc.check_reads(row_idx.data_ptr<int64_t>(), B, need.data());
  const float scale = static_cast<float>(scale_d);
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_group(B, H, Hkv, D, row_idx.data_ptr<int64_t>(), kc, vc, need.data(),
                 [&](int64_t b, int64_t h0, int64_t h1, const Keys& kb, const Keys& vb, Scratch& s) {
                   Group grp;
                   for (int64_t h = h0; h < h1; ++h)
                     for (int64_t t = 0; t < T; ++t) {
                       const auto& idx = seen[b * T + t];
                       grp.add(qp + ((b * H + h) * T + t) * D, static_cast<int64_t>(idx.size()),
                               op + ((b * H + h) * T + t) * D, idx.data());
                     }
                   attend_group<true>(grp, kb, vb, D, scale, s);
                 });
  return out;
}
