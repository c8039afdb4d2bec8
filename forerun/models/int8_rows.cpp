// int8 linear for a few tokens (decoding, verifying a draft): one call instead of six ops.
//
// Same numerics as forerun's fbgemm path (models/quant.py), bit for bit:
//   0. optionally x = rms_norm(x) * norm_w first (the RMSNorm that feeds this linear);
//   1. each token row x is divided by its own max |x| (float division, as torch.div);
//   2. quantised to uint8 the way fbgemm's Quantize does: nearbyint(fma(x, 1 / scale, zero)),
//      clamped to [0, 255], with the scale / zero point fbgemm picks for the range [-1, 1];
//   3. int32 dot products with the int8 weight rows (exact, so any kernel agrees);
//   4. fbgemm's float epilogue: (acc - zero * colsum[j]) * x_scale * w_scale[j], then
//      times the row's max |x|, plus bias.
// Each token is computed on its own, so its result never depends on its batch-mates.
// The dot product uses AVX512-VNNI when the compiler targets it, plain C++ otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_VNNI 1
#endif

// Weights are packed once (Int8Linear, `pack_weight` in quant.py) as [M/16][K/4][16][4]:
// 64 bytes = 4 consecutive k of 16 consecutive outputs, which is exactly one VNNI
// instruction's worth. A token's 4 activation bytes are broadcast to all 16 lanes, so the
// int32 accumulators hold 16 outputs each and need no horizontal sums; one weight load
// serves up to 8 tokens (3 blocks x 8 tokens = 24 accumulators + 3 weight vectors + 1
// broadcast: within the 32 registers), so verifying k + 1 <= 8 tokens streams each weight
// once. M is padded to a multiple of 48 and K to one of 4 (zero weights).
constexpr int64_t OUT_BLOCK = 16, CHUNK_BLOCKS = 3, K_GROUP = 4, MAX_TOKENS = 8;

// acc[b * TB + t] += <activations of token t, weights of output block b> over all of K.
template <int TB>
static inline void chunk_dots(const uint8_t* q, int64_t Kp, const int8_t* w, int64_t G, int32_t* out) {
#ifdef FORERUN_VNNI
  __m512i acc[CHUNK_BLOCKS][TB];
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) acc[b][t] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[CHUNK_BLOCKS];
    for (int b = 0; b < CHUNK_BLOCKS; ++b) wv[b] = _mm512_loadu_si512(w + (b * G + g) * 64);
    for (int t = 0; t < TB; ++t) {
      int32_t four;
      std::memcpy(&four, q + t * Kp + g * K_GROUP, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int b = 0; b < CHUNK_BLOCKS; ++b) acc[b][t] = _mm512_dpbusd_epi32(acc[b][t], a, wv[b]);
    }
  }
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) _mm512_storeu_si512(out + (b * TB + t) * OUT_BLOCK, acc[b][t]);
#else
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t)
      for (int l = 0; l < OUT_BLOCK; ++l) {
        int32_t s = 0;
        for (int64_t g = 0; g < G; ++g)
          for (int k = 0; k < K_GROUP; ++k)
            s += int32_t(q[t * Kp + g * K_GROUP + k]) * int32_t(w[((b * G + g) * OUT_BLOCK + l) * K_GROUP + k]);
        out[(b * TB + t) * OUT_BLOCK + l] = s;
      }
#endif
}

// RMSNorm of one row, the folded norm of int8_rows (also exported as rms_norm_rows so the
// oneDNN / fbgemm paths use the very same bits): x * (1 / sqrt(mean(x^2) + eps)) * w.
static inline void norm_row(const float* r, const float* w, int64_t K, double eps, float* out) {
  double ss = 0.0;
  for (int64_t k = 0; k < K; ++k) ss += double(r[k]) * r[k];
  const float inv_rms = static_cast<float>(1.0 / std::sqrt(ss / K + eps));
  for (int64_t k = 0; k < K; ++k) out[k] = (r[k] * inv_rms) * w[k];
}

torch::Tensor rms_norm_rows(torch::Tensor x_in, torch::Tensor w, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
              w.numel() == x_in.size(-1), "rms_norm_rows: float32 x [..., K], w [K]");
  const auto x = x_in.contiguous();
  const auto wc = w.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K;
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) norm_row(xp + i * K, wp, K, eps, op + i * K);
  });
  return out;
}

// Step 0-2 of the numerics above for N rows of K floats: q [N, Kp] (padding left as it
// is), row_max [N]. Shared with int4_rows.cpp, so both kernels see the same activation bytes.
void quantize_rows(const float* xp, int64_t N, int64_t K, int64_t Kp, const float* nw, double eps, float inv,
                   int32_t zero, uint8_t* q, float* row_max) {
  std::vector<float> normed(nw ? K : 0);
  for (int64_t i = 0; i < N; ++i) {
    const float* r = xp + i * K;
    if (nw) {
      norm_row(r, nw, K, eps, normed.data());
      r = normed.data();
    }
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s = std::max(s, std::fabs(r[k]));
    s = std::max(s, 1e-12f);
    row_max[i] = s;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(std::fma(r[k] / s, inv, static_cast<float>(zero)));  // fbgemm: fma, then round
      q[i * Kp + k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, v)));
    }
  }
}

// x [..., K] float32; w_packed [Mp/16, Kp/4, 16, 4] int8; w_scale, colsum, bias (or empty) [M];
// norm_w [K] or empty (no RMSNorm) -> [..., M] float32.
torch::Tensor int8_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor w_scale, torch::Tensor colsum,
                        torch::Tensor bias, torch::Tensor norm_w, double eps, double x_scale, int64_t x_zero) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.size(2) == OUT_BLOCK &&
              w.size(3) == K_GROUP && w.size(0) % CHUNK_BLOCKS == 0, "w: packed int8 [Mp/16, Kp/4, 16, 4]");
  const auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K, M = w_scale.numel();
  const int64_t G = w.size(1), Kp = G * K_GROUP, chunks = w.size(0) / CHUNK_BLOCKS;
  TORCH_CHECK(Kp >= K && Kp < K + K_GROUP && w.size(0) * OUT_BLOCK >= M, "packed weight does not fit x / w_scale");
  TORCH_CHECK(colsum.numel() == M && colsum.scalar_type() == torch::kInt32 && w_scale.scalar_type() == torch::kFloat32 &&
              (bias.numel() == 0 || bias.numel() == M), "w_scale, colsum, bias: [M]");
  const float xs = static_cast<float>(x_scale), inv = 1.0f / xs;
  const int32_t zero = static_cast<int32_t>(x_zero);
  TORCH_CHECK(norm_w.numel() == 0 || norm_w.numel() == K, "norm_w: [K] or empty");
  const float* xp = x.data_ptr<float>();
  const float* nw = norm_w.numel() ? norm_w.data_ptr<float>() : nullptr;
  std::vector<uint8_t> q(N * Kp, 0);  // padding k: any value works (its weights are 0)
  std::vector<float> row_max(N);
  quantize_rows(xp, N, K, Kp, nw, eps, inv, zero, q.data(), row_max.data());
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  auto out = torch::empty(out_shape, x.options());
  float* op = out.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const int32_t* csp = colsum.data_ptr<int32_t>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  // y = float(acc - zero * colsum) * (x_scale * w_scale) * row_max (+ bias): fbgemm's order.
  auto epilogue = [&](const int32_t* a16, int64_t j0, int64_t i) {
    const int64_t n = std::min<int64_t>(OUT_BLOCK, M - j0);
    float* dst = op + i * M + j0;
#ifdef FORERUN_VNNI
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1u);
    const __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(a16),
                                       _mm512_mullo_epi32(_mm512_set1_epi32(zero), _mm512_maskz_loadu_epi32(mk, csp + j0)));
    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(xs), _mm512_maskz_loadu_ps(mk, wsp + j0));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), sc), _mm512_set1_ps(row_max[i]));
    if (bp) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mk, bp + j0));
    _mm512_mask_storeu_ps(dst, mk, y);
#else
    for (int64_t l = 0; l < n; ++l) {
      const int32_t a = a16[l] - zero * csp[j0 + l];
      const float y = static_cast<float>(a) * (xs * wsp[j0 + l]) * row_max[i];
      dst[l] = bp ? y + bp[j0 + l] : y;
    }
#endif
  };
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    int32_t acc[CHUNK_BLOCKS * MAX_TOKENS * OUT_BLOCK];
    for (int64_t c = c0; c < c1; ++c) {
      const int8_t* wc = wp + c * CHUNK_BLOCKS * G * OUT_BLOCK * K_GROUP;
      for (int64_t t0 = 0; t0 < N; t0 += MAX_TOKENS) {
        const int TB = static_cast<int>(std::min<int64_t>(MAX_TOKENS, N - t0));
        const uint8_t* qt = q.data() + t0 * Kp;
        switch (TB) {
          case 1: chunk_dots<1>(qt, Kp, wc, G, acc); break;
          case 2: chunk_dots<2>(qt, Kp, wc, G, acc); break;
          case 3: chunk_dots<3>(qt, Kp, wc, G, acc); break;
          case 4: chunk_dots<4>(qt, Kp, wc, G, acc); break;
          case 5: chunk_dots<5>(qt, Kp, wc, G, acc); break;
          case 6: chunk_dots<6>(qt, Kp, wc, G, acc); break;
          case 7: chunk_dots<7>(qt, Kp, wc, G, acc); break;
          default: chunk_dots<8>(qt, Kp, wc, G, acc); break;
        }
        for (int b = 0; b < CHUNK_BLOCKS; ++b) {
          const int64_t j0 = (c * CHUNK_BLOCKS + b) * OUT_BLOCK;
          if (j0 >= M) break;
          for (int t = 0; t < TB; ++t) epilogue(acc + (b * TB + t) * OUT_BLOCK, j0, t0 + t);
        }
      }
    }
  });
  return out;
}

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
// One query's attention over keys [0, L), AVX512, for D a multiple of 16 (<= 256).
// Fixed instruction sequence for a given (L, D): the batch around the query never matters.
static void attend_one_avx512(const float* qv, const float* kb, const float* vb, int64_t L, int64_t D,
                              float scale, float* p, float* o) {
  const int64_t V = D / 16;
  __m512 qr[16];
  for (int64_t c = 0; c < V; ++c) qr[c] = _mm512_loadu_ps(qv + 16 * c);
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {  // 4 keys at a time: independent FMA chains
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* k0 = kb + j * D;
    for (int64_t c = 0; c < V; ++c) {
      a0 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k0 + 16 * c), a0);
      a1 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k0 + D + 16 * c), a1);
      a2 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k0 + 2 * D + 16 * c), a2);
      a3 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k0 + 3 * D + 16 * c), a3);
    }
    p[j] = _mm512_reduce_add_ps(a0) * scale;
    p[j + 1] = _mm512_reduce_add_ps(a1) * scale;
    p[j + 2] = _mm512_reduce_add_ps(a2) * scale;
    p[j + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; j < L; ++j) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t c = 0; c < V; ++c) a0 = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(kb + j * D + 16 * c), a0);
    p[j] = _mm512_reduce_add_ps(a0) * scale;
  }
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (j = 0; j + 16 <= L; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(p + j));
  float m = _mm512_reduce_max_ps(mx);
  for (; j < L; ++j) m = std::max(m, p[j]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum_v = _mm512_setzero_ps();
  j = 0;
  for (; j + 16 <= L; j += 16) {
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
  __m512 acc[2][16];
  for (int64_t c = 0; c < V; ++c) acc[0][c] = acc[1][c] = _mm512_setzero_ps();
  for (j = 0; j + 2 <= L; j += 2) {  // two chains (even / odd keys), joined at the end
    const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
    const float* v0 = vb + j * D;
    for (int64_t c = 0; c < V; ++c) {
      acc[0][c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), acc[0][c]);
      acc[1][c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v0 + D + 16 * c), acc[1][c]);
    }
  }
  if (j < L) {
    const __m512 p0 = _mm512_set1_ps(p[j]);
    for (int64_t c = 0; c < V; ++c) acc[0][c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + j * D + 16 * c), acc[0][c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(acc[0][c], acc[1][c]), inv));
}
#endif

// Attention where query t of batch entry b sees keys [0, limits[b, t]) of its cache row (a
// chain: every query sees a prefix). q [B, H, T, D]; k/v: the layer's whole cache
// [rows, Hkv, capacity, D]; rows [B]; limits [B, T] -> [B, H, T, D]. Each (b, h, t) is
// computed alone, in the same order for any T: scoring k drafted tokens at once gives
// each the bits that scoring it alone would. (SDPA's kernels tile queries together.)
torch::Tensor attend_prefix(torch::Tensor q_in, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                            torch::Tensor limits, double scale_d) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == torch::kFloat32, "q: float32 [B, H, T, D]");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
              k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32, "k, v: float32 [rows, Hkv, cap, D]");
  const auto q = q_in.contiguous();
  const auto row_idx = rows.to(torch::kLong).contiguous();
  const auto lim = limits.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), cap = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0, "head shapes");
  TORCH_CHECK(row_idx.numel() == B && lim.size(0) == B && lim.size(1) == T, "rows [B], limits [B, T]");
  const int64_t group = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  auto out = torch::empty({B, H, T, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t *rp = row_idx.data_ptr<int64_t>(), *lp = lim.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= cap, "a query must see between 1 and capacity keys");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < k.size(0), "cache row out of range");
  at::parallel_for(0, B * H, 1, [&](int64_t bh0, int64_t bh1) {
    std::vector<float> p(cap), acc0(D), acc1(D);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const int64_t b = bh / H, h = bh % H, hk = h / group;
      const float* kb = kp + (rp[b] * Hkv + hk) * cap * D;
      const float* vb = vp + (rp[b] * Hkv + hk) * cap * D;
      for (int64_t t = 0; t < T; ++t) {
        const float* qv = qp + ((b * H + h) * T + t) * D;
        const int64_t L = lp[b * T + t];
#ifdef FORERUN_VNNI
        if (D % 16 == 0 && D <= 256) {
          attend_one_avx512(qv, kb, vb, L, D, scale, p.data(), op + ((b * H + h) * T + t) * D);
          continue;
        }
#endif
        int64_t j = 0;
        for (; j + 4 <= L; j += 4) dots<4>(qv, kb + j * D, D, p.data() + j);
        for (; j < L; ++j) dots<1>(qv, kb + j * D, D, p.data() + j);
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
        float* o = op + ((b * H + h) * T + t) * D;
        for (int64_t d = 0; d < D; ++d) acc0[d] = acc1[d] = 0.f;
        for (j = 0; j + 2 <= L; j += 2) {  // two chains (even / odd keys), joined at the end
          const float p0 = p[j], p1 = p[j + 1];
          const float *v0 = vb + j * D, *v1 = v0 + D;
          for (int64_t d = 0; d < D; ++d) {
            acc0[d] = std::fma(p0, v0[d], acc0[d]);
            acc1[d] = std::fma(p1, v1[d], acc1[d]);
          }
        }
        if (j < L)
          for (int64_t d = 0; d < D; ++d) acc0[d] = std::fma(p[j], vb[j * D + d], acc0[d]);
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] = (acc0[d] + acc1[d]) * inv;
      }
    }
  });
  return out;
}

bool has_vnni() {
#ifdef FORERUN_VNNI
  return true;
#else
  return false;
#endif
}

torch::Tensor f32_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor bias, int64_t M);  // f32_rows.cpp
torch::Tensor int4_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                        torch::Tensor bias, torch::Tensor norm_w, double eps, double x_scale, int64_t x_zero,
                        int64_t M);  // int4_rows.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_rows", &f32_rows, "float32 linear, one FMA chain per output: the same bits for any number of rows");
  m.def("int8_rows", &int8_rows, "per-token int8 linear for a few rows");
  m.def("int4_rows", &int4_rows, "per-token linear over 4-bit group-quantised weights, any number of rows");
  m.def("rms_norm_rows", &rms_norm_rows, "the folded RMSNorm of int8_rows, on its own");
  m.def("attend_prefix", &attend_prefix, "attention over key prefixes, one query at a time");
  m.def("has_vnni", &has_vnni, "whether the dot product was compiled with AVX512-VNNI");
}
