// Chain attention for a few new tokens, one query at a time (the int8, int4 and float32
// CPU models): each (row, head, query) is computed alone, in the same order for any number
// of queries, so scoring k drafted tokens at once gives each the bits that scoring it alone
// would (SDPA's kernels tile queries together, so their bits depend on the batch).
//
// attend_prefix: the attention alone. rope_write_attend: a whole attention layer between
// its q/k/v linear and its output linear (RoPE, the KV cache write, attention) in one call,
// which on a 24-28 layer model saves ~1-2 ms of small torch ops per forward.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_VNNI 1  // the same switch as int8_rows.cpp: one ISA level for every kernel
#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into an integer
// power (exponent bits) and a degree-6 polynomial on [0, 1); ~2 ulp, branch-free so the
// compiler vectorises the loop that calls it. The same code runs for every query, which
// is the point: a query's result never depends on how many queries share the call.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
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
// One query's attention over keys [0, L), AVX512, D = 16 V. Fixed instruction sequence for
// a given (L, D); V is a template argument so the query and accumulators stay in registers.
// A key's score is one FMA chain over D then one horizontal sum, whichever block of keys
// it is computed in (8 keys in flight hide the FMA latency). IDX: the query sees the keys
// at rows idx[0 .. L) (a token tree's prefix and ancestors, in slot order) instead of rows
// 0 .. L: the same arithmetic over that list, so a tree node gets the bits its chain would.
template <int V, bool IDX>
static void attend_one_avx512(const float* qv, const float* kb, const float* vb, int64_t L, float scale, float* p,
                              float* o, const int32_t* idx) {
  constexpr int64_t D = 16 * V;
  auto key = [&](int64_t j) -> int64_t { return IDX ? idx[j] : j; };
  __m512 qr[V];
  for (int c = 0; c < V; ++c) qr[c] = _mm512_loadu_ps(qv + 16 * c);
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    __m512 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
    const float* kr[8];
    for (int r = 0; r < 8; ++r) kr[r] = kb + key(j + r) * D;
    for (int c = 0; c < V; ++c)
      for (int r = 0; r < 8; ++r) a[r] = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kr[r] + 16 * c), a[r]);
    for (int r = 0; r < 8; ++r) p[j + r] = _mm512_reduce_add_ps(a[r]) * scale;
  }
  for (; j < L; ++j) {
    __m512 a0 = _mm512_setzero_ps();
    for (int c = 0; c < V; ++c) a0 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kb + key(j) * D + 16 * c), a0);
    p[j] = _mm512_reduce_add_ps(a0) * scale;
  }
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (j = 0; j + 16 <= L; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(p + j));
  float m = _mm512_reduce_max_ps(mx);
  for (; j < L; ++j) m = std::max(m, p[j]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum_v = _mm512_setzero_ps();
  for (j = 0; j + 16 <= L; j += 16) {  // exp_nonpositive, 16 lanes at a time
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
  __m512 acc0[V], acc1[V];
  for (int c = 0; c < V; ++c) acc0[c] = acc1[c] = _mm512_setzero_ps();
  for (j = 0; j + 2 <= L; j += 2) {  // two chains (even / odd keys), joined at the end
    const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
    const float *v0 = vb + key(j) * D, *v1 = vb + key(j + 1) * D;
    for (int c = 0; c < V; ++c) {
      acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc0[c]);
      acc1[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), acc1[c]);
    }
  }
  if (j < L) {
    const __m512 p0 = _mm512_set1_ps(p[j]);
    for (int c = 0; c < V; ++c) acc0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + key(j) * D + 16 * c), acc0[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(acc0[c], acc1[c]), inv));
}
#endif

// The same attention in plain C++ (any D; every ISA). p [L], acc0 / acc1 [D]: scratch;
// idx as in attend_one_avx512 (nullptr: keys 0 .. L).
static void attend_one_scalar(const float* qv, const float* kb, const float* vb, int64_t L, int64_t D, float scale,
                              float* p, float* acc0, float* acc1, float* o, const int32_t* idx) {
  auto key = [&](int64_t j) -> int64_t { return idx ? idx[j] : j; };
  int64_t j = 0;
  if (idx)  // (dots<R> gives each key the same arithmetic for any R)
    for (; j < L; ++j) dots<1>(qv, kb + key(j) * D, D, p + j);
  for (; j + 4 <= L; j += 4) dots<4>(qv, kb + j * D, D, p + j);
  for (; j < L; ++j) dots<1>(qv, kb + j * D, D, p + j);
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
    const float *v0 = vb + key(j) * D, *v1 = vb + key(j + 1) * D;
    for (int64_t d = 0; d < D; ++d) {
      acc0[d] = std::fma(p0, v0[d], acc0[d]);
      acc1[d] = std::fma(p1, v1[d], acc1[d]);
    }
  }
  if (j < L)
    for (int64_t d = 0; d < D; ++d) acc0[d] = std::fma(p[j], vb[key(j) * D + d], acc0[d]);
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) o[d] = (acc0[d] + acc1[d]) * inv;
}

// Per-thread scratch for one query at a time.
struct Scratch {
  std::vector<float> p, acc0, acc1;
  Scratch(int64_t cap, int64_t D) : p(cap), acc0(D), acc1(D) {}
};

// One query's attention over keys [0, L) of one cache row and KV head (kb, vb [cap, D]), or
// over the keys at rows idx[0 .. L) when idx is given (IDX).
template <bool IDX>
static void attend_one(const float* qv, const float* kb, const float* vb, int64_t L, int64_t D, float scale,
                       Scratch& s, float* o, const int32_t* idx = nullptr) {
#ifdef FORERUN_VNNI
  switch (D) {  // every multiple of 16 up to 256; other head sizes take the plain C++ path
    case 16: return IDX ? attend_one_avx512<1, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<1, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 32: return IDX ? attend_one_avx512<2, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<2, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 48: return IDX ? attend_one_avx512<3, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<3, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 64: return IDX ? attend_one_avx512<4, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<4, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 80: return IDX ? attend_one_avx512<5, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<5, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 96: return IDX ? attend_one_avx512<6, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<6, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 112: return IDX ? attend_one_avx512<7, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<7, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 128: return IDX ? attend_one_avx512<8, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<8, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 144: return IDX ? attend_one_avx512<9, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<9, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 160: return IDX ? attend_one_avx512<10, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<10, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 176: return IDX ? attend_one_avx512<11, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<11, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 192: return IDX ? attend_one_avx512<12, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<12, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 208: return IDX ? attend_one_avx512<13, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<13, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 224: return IDX ? attend_one_avx512<14, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<14, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 240: return IDX ? attend_one_avx512<15, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<15, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    case 256: return IDX ? attend_one_avx512<16, true>(qv, kb, vb, L, scale, s.p.data(), o, idx)
                   : attend_one_avx512<16, false>(qv, kb, vb, L, scale, s.p.data(), o, idx);
    default: break;
  }
#endif
  attend_one_scalar(qv, kb, vb, L, D, scale, s.p.data(), s.acc0.data(), s.acc1.data(), o, IDX ? idx : nullptr);
}

static void check_cache(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
              k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32, "k, v: float32 [rows, Hkv, cap, D]");
}

// rows [B] as contiguous int64, each checked to be a row of the cache k [rows, Hkv, cap, D].
static torch::Tensor cache_rows(const torch::Tensor& rows, int64_t B, const torch::Tensor& k) {
  auto r = rows.to(torch::kLong).contiguous();
  TORCH_CHECK(r.numel() == B, "rows [B]");
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < k.size(0), "cache row out of range");
  return r;
}

// body(b, h, kb, vb, scratch) for every batch entry b and query head h, in parallel; kb / vb
// point at the K / V of b's cache row (rp[b]) for h's KV head.
template <class Body>
static void for_each_head(int64_t B, int64_t H, int64_t Hkv, int64_t cap, int64_t D, const int64_t* rp,
                          const float* kp, const float* vp, Body body) {
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {
    Scratch s(cap, D);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / H, h = bh % H, at = (rp[b] * Hkv + h / group) * cap * D;
      body(b, h, kp + at, vp + at, s);
    }
  });
}

// Attention where query t of batch entry b sees keys [0, limits[b, t]) of its cache row (a
// chain: every query sees a prefix). q [B, H, T, D]; k/v: the layer's whole cache
// [rows, Hkv, capacity, D]; rows [B]; limits [B, T] -> [B, H, T, D].
torch::Tensor attend_prefix(torch::Tensor q_in, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                            torch::Tensor limits, double scale_d) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == torch::kFloat32, "q: float32 [B, H, T, D]");
  check_cache(k, v);
  const auto q = q_in.contiguous();
  const auto lim = limits.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), cap = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(lim.size(0) == B && lim.size(1) == T, "limits [B, T]");
  const auto row_idx = cache_rows(rows, B, k);
  const float scale = static_cast<float>(scale_d);
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* lp = lim.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "a query must see between 1 and capacity keys");
  for_each_head(B, H, Hkv, cap, D, row_idx.data_ptr<int64_t>(), k.data_ptr<float>(), v.data_ptr<float>(),
                [&](int64_t b, int64_t h, const float* kb, const float* vb, Scratch& s) {
                  for (int64_t t = 0; t < T; ++t)
                    attend_one<false>(qp + ((b * H + h) * T + t) * D, kb, vb, lp[b * T + t], D, scale, s,
                                      op + ((b * H + h) * T + t) * D);
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
// k, v: the layer's cache [rows, Hkv, cap, D]; rows [B]; slots [B, T] -> [B, T, H D], the
// layout the output linear reads (no transpose copy).
torch::Tensor rope_write_attend(torch::Tensor qkv_in, torch::Tensor cos_in, torch::Tensor sin_in, torch::Tensor k,
                                torch::Tensor v, torch::Tensor rows, torch::Tensor slots, int64_t heads,
                                int64_t kv_heads, double scale_d) {
  check_cache(k, v);
  const int64_t H = heads, Hkv = kv_heads, D = k.size(3), cap = k.size(2);
  TORCH_CHECK(qkv_in.dim() == 3 && qkv_in.scalar_type() == torch::kFloat32 && qkv_in.size(2) == (H + 2 * Hkv) * D,
              "qkv: float32 [B, T, (heads + 2 kv_heads) head_dim]");
  TORCH_CHECK(Hkv == k.size(1) && H % Hkv == 0 && D % 2 == 0, "head shapes");
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1), W = qkv_in.size(2);
  const auto qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.numel() == B * T * D && sin.numel() == B * T * D, "cos, sin: float32 [B, 1, T, head_dim]");
  const auto row_idx = cache_rows(rows, B, k);
  const auto slot = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(slot.numel() == B * T, "slots [B, T]");
  const int64_t *rp = row_idx.data_ptr<int64_t>(), *sp = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < cap, "slot outside the cache");
  auto q = torch::empty({B, H, T, D}, qkv.options());
  auto out = torch::empty({B, T, H * D}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * T, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / T, t = i % T;
      const float *x = xp + i * W, *c = cp + i * D, *s = snp + i * D;
      for (int64_t h = 0; h < H; ++h) rotate_half(x + h * D, c, s, D, qp + ((b * H + h) * T + t) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = ((rp[b] * Hkv + h) * cap + sp[i]) * D;
        rotate_half(x + (H + h) * D, c, s, D, kp + at);
        std::memcpy(vp + at, x + (H + Hkv + h) * D, D * sizeof(float));
      }
    }
  });
  const float scale = static_cast<float>(scale_d);
  for_each_head(B, H, Hkv, cap, D, rp, kp, vp, [&](int64_t b, int64_t h, const float* kb, const float* vb, Scratch& s) {
    for (int64_t t = 0; t < T; ++t)
      attend_one<false>(qp + ((b * H + h) * T + t) * D, kb, vb, sp[b * T + t] + 1, D, scale, s, op + (b * T + t) * H * D + h * D);
  });
  return out;
}

// Attention under an explicit mask (token trees): query t of batch entry b sees the slots
// j < S of its cache row where mask[b, t, j], in slot order, through the same per-query
// code as a chain. A tree node's visible keys are the prefix and its ancestors, whose K/V
// carry the bits its chain would have given them (same tokens, same RoPE positions), so
// the node's output equals the chain's: int8 tree verification keeps plain decoding's bits.
// q [B, H, T, D]; k/v [rows, Hkv, cap, D]; rows [B]; mask [B, T, S] bool -> [B, H, T, D].
torch::Tensor attend_masked(torch::Tensor q_in, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                            torch::Tensor mask_in, double scale_d) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == torch::kFloat32, "q: float32 [B, H, T, D]");
  check_cache(k, v);
  const auto q = q_in.contiguous();
  const auto mask = mask_in.to(torch::kBool).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), cap = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T && mask.size(2) <= cap,
              "mask [B, T, S] with S <= capacity");
  const auto row_idx = cache_rows(rows, B, k);
  const int64_t S = mask.size(2);
  const bool* mp = mask.data_ptr<bool>();
  std::vector<std::vector<int32_t>> seen(B * T);  // visible slots per query, in slot order
  for (int64_t i = 0; i < B * T; ++i) {
    for (int64_t j = 0; j < S; ++j)
      if (mp[i * S + j]) seen[i].push_back(static_cast<int32_t>(j));
    TORCH_CHECK(!seen[i].empty(), "a query must see at least one key");
  }
  const float scale = static_cast<float>(scale_d);
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_head(B, H, Hkv, cap, D, row_idx.data_ptr<int64_t>(), k.data_ptr<float>(), v.data_ptr<float>(),
                [&](int64_t b, int64_t h, const float* kb, const float* vb, Scratch& s) {
                  for (int64_t t = 0; t < T; ++t) {
                    const auto& idx = seen[b * T + t];
                    attend_one<true>(qp + ((b * H + h) * T + t) * D, kb, vb, static_cast<int64_t>(idx.size()), D,
                                     scale, s, op + ((b * H + h) * T + t) * D, idx.data());
                  }
                });
  return out;
}
