// int4's weight grids, fitted to the weights: per group of 64 inputs w ~ d * u + m, u in 0..15,
// d and m float16 (int4_fit_groups); or as Q4_K blocks, one line per sub-block of 32 with 6-bit
// multiples of two float16 scales per 256 inputs (int4_fit_q4k, fit_q4k below: the lines are
// fitted as here, without the float16 rounding, then each sub-block's 6-bit pair chosen).
//
// The min-max grid (m = min, d = (max - min) / 15) puts two of 16 levels on the group's two
// extremes and spaces the rest for them. A grid fitted to all 64 values is closer: on the
// Qwen2.5-Coder-1.5B's linears (groups re-quantized from Q4_K / Q6_K blocks) it lowers int4's
// KL from float32 by a quarter (0.035 -> 0.027, two 512-token chunks, activations per group
// of 64 as the kernel computes them), at the same 4.5 bits a weight and the same kernel.
//
// Per group (n real inputs: the last group of a row may be part padding, which is never fitted
// and gets u = 0), with h(v) = v rounded to float16 and back:
//   grid(d, m): u_i = nearbyint((x_i - m) * (1 / d)) clamped to 0..15 (u = 0 where d = 0)
//   err(d, m) = sum_i (d * u_i + m - x_i)^2
//   start s in {0, 0.05, 0.1, 0.15, 0.2}: the range narrowed by s, m = h(lo + s (hi - lo) / 2),
//     d = h((hi - lo)(1 - s) / 15) (s = 0: the min-max grid, h((hi - h(lo)) / 15) as before)
//   then up to ITERS times: d, m <- the least-squares line through (u_i, x_i), h() of each
//     (d >= 0), until that gives the same grid again
// keeping the grid with the smallest err, the earliest on ties: a group already on a 4-bit
// float16 grid comes back exactly (its min-max grid has err 0), and no group is fitted worse
// than min-max. Each group's arithmetic is fixed (sums in 16 lanes, then the lanes pairwise, in
// the AVX512 loop and the scalar one alike), so the result depends on neither threads nor build.
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 64, ITERS = 4, LANES = 16;
constexpr float SHRINKS[] = {0.f, 0.05f, 0.1f, 0.15f, 0.2f};

inline float h(float v) {
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}

// Sums over a group in one fixed order, whatever the build: 16 lanes (lane l takes the values
// l, l + 16, ... in turn), then the lanes pairwise (l + 8 onto l, then + 4, + 2, + 1).
inline float lanes_total(const float* acc) {
  float t[LANES];
  for (int64_t l = 0; l < LANES; ++l) t[l] = acc[l];
  for (int64_t w = LANES / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

struct Eval {
  float err, su, suu, sux;  // sum (d u + m - x)^2, sum u, sum u^2, sum u x
};

// u for grid (d, m) over x[0..n): u = nearbyint((x - m) * (1 / d)) in 0..15 (0 where d = 0).
Eval grid(const float* x, int64_t n, float d, float m, uint8_t* u) {
  const float inv = d > 0.f ? 1.f / d : 0.f;
  float err[LANES] = {}, su[LANES] = {}, suu[LANES] = {}, sux[LANES] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n % LANES == 0) {  // a whole group of 64, or a Q4_K sub-block of 32
    __m512 e2 = _mm512_setzero_ps(), s1 = e2, s2 = e2, s3 = e2;
    const __m512 vm = _mm512_set1_ps(m), vd = _mm512_set1_ps(d), vi = _mm512_set1_ps(inv);
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(15.f);
    for (; i < n; i += LANES) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(xv, vm), vi), _MM_FROUND_CUR_DIRECTION);
      const __m512 q = _mm512_min_ps(top, _mm512_max_ps(r, zero));  // (r, zero): NaN -> 0, as std::max(0.f, r)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
      const __m512 e = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(vd, q), vm), xv);
      e2 = _mm512_add_ps(e2, _mm512_mul_ps(e, e));
      s1 = _mm512_add_ps(s1, q);
      s2 = _mm512_add_ps(s2, _mm512_mul_ps(q, q));
      s3 = _mm512_add_ps(s3, _mm512_mul_ps(q, xv));
    }
    _mm512_storeu_ps(err, e2);
    _mm512_storeu_ps(su, s1);
    _mm512_storeu_ps(suu, s2);
    _mm512_storeu_ps(sux, s3);
  }
#endif
  for (; i < n; ++i) {  // the same operations, lane by lane (and a group's real part when shorter)
    const float r = std::nearbyint((x[i] - m) * inv);
    const float q = std::min(15.f, std::max(0.f, r));
    u[i] = static_cast<uint8_t>(q);
    const float e = (d * q + m) - x[i];
    const int64_t l = i % LANES;
    err[l] += e * e;
    su[l] += q;
    suu[l] += q * q;
    sux[l] += q * x[i];
  }
  return {lanes_total(err), lanes_total(su), lanes_total(suu), lanes_total(sux)};
}

// The best (d, m) for x[0..n), n <= 64, as above; `half`: d and m rounded to float16 at each
// step (int4's own grids), else left as floats (a Q4_K sub-block's, whose scales are 6-bit
// multiples of a per-256 scale, chosen after: fit_q4k).
void fit_line(const float* x, int64_t n, bool half, float* d_out, float* m_out) {
  const auto r = [half](double v) { return half ? h(static_cast<float>(v)) : static_cast<float>(v); };
  float lo = x[0], hi = x[0], sx_l[LANES] = {};
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sx_l[i % LANES] += x[i];
  }
  const double sx = lanes_total(sx_l);
  uint8_t u[GROUP];
  float best_err = INFINITY, best_d = 0.f, best_m = 0.f;
  for (const float s : SHRINKS) {
    if (best_err == 0.f) break;
    float m = r(lo + s * (hi - lo) / 2), d = s == 0.f ? r((hi - m) / 15) : r((hi - lo) * (1 - s) / 15);
    for (int64_t it = 0;; ++it) {
      const Eval e = grid(x, n, d, m, u);
      if (e.err < best_err) {
        best_err = e.err;
        best_d = d;
        best_m = m;
      }
      if (it == ITERS || best_err == 0.f) break;  // (nothing beats an exact grid: a GGUF block's own)
      const double det = double(n) * e.suu - double(e.su) * e.su;
      if (!(det > 0)) break;  // every u equal: no line to fit
      const double dd = std::max(0.0, (double(n) * e.sux - e.su * sx) / det);
      const float d2 = r(dd), m2 = r((sx - dd * e.su) / n);
      if (d2 == d && m2 == m) break;  // converged: the same grid again
      d = d2;
      m = m2;
    }
  }
  *d_out = best_d;
  *m_out = best_m;
}

void fit_group(const float* x, int64_t n, uint8_t* u_out, uint16_t* d_out, uint16_t* m_out) {
  float d, m;
  fit_line(x, n, true, &d, &m);
  grid(x, n, d, m, u_out);
  *d_out = c10::detail::fp16_ieee_from_fp32_value(d);
  *m_out = c10::detail::fp16_ieee_from_fp32_value(m);
}


// One Q4_K super-block of 256 values -> its 144 bytes (ggml's layout: d, dmin float16; 12 bytes
// of 6-bit scales and mins; 128 bytes of 4-bit values), w = (d sc_j) q - (dmin mn_j) on each
// sub-block j of 32. Each sub-block's line is fitted as above (floats, not float16), its minimum
// held at or below 0 (mn_j >= 0); d = h(max_j s_j / 63), dmin = h(max_j mn_j / 63), as ggml's
// own quantizer sets them; then per sub-block the 6-bit (sc, mn) pair with the least squared
// error among the rounded ratio and its neighbours (+-1, rounded first: ties keep it) is kept.
// A block already on a Q4_K grid comes back byte for byte when each sub-block's min-max line is
// its own (it uses levels 0 and 15) and its largest sc and mn are 63 (as ggml writes them); a
// GGUF's blocks often leave a level unused, so int4 of a GGUF keeps them instead (linears/int4.py).
void fit_q4k(const float* x, uint8_t* out) {
  constexpr int64_t SUB = 32, NSUB = 8;
  float s[NSUB], mn[NSUB], smax = 0.f, mmax = 0.f;
  for (int64_t j = 0; j < NSUB; ++j) {
    float d, m;
    fit_line(x + SUB * j, SUB, false, &d, &m);
    if (m > 0.f) {  // the fitted line starts above 0 (e.g. all 32 values positive): restart it at 0
      float hi = 0.f;
      for (int64_t i = 0; i < SUB; ++i) hi = std::max(hi, x[SUB * j + i]);
      d = hi / 15;
      m = 0.f;
    }
    s[j] = std::isfinite(d) && d > 0.f ? d : 0.f;
    mn[j] = std::isfinite(m) && m < 0.f ? -m : 0.f;
    smax = std::max(smax, s[j]);
    mmax = std::max(mmax, mn[j]);
  }
  const float D = h(std::min(smax / 63, 65504.f)), Dm = h(std::min(mmax / 63, 65504.f));  // (float16's largest)
  uint8_t sc[NSUB], mq[NSUB], u[SUB], q[256];
  for (int64_t j = 0; j < NSUB; ++j) {
    const auto near = [](float v, float unit) {
      return unit > 0.f ? static_cast<int>(std::min(63.f, std::max(0.f, std::nearbyint(v / unit)))) : 0;
    };
    const int s0 = near(s[j], D), m0 = near(mn[j], Dm);
    float best = INFINITY;
    sc[j] = static_cast<uint8_t>(s0);
    mq[j] = static_cast<uint8_t>(m0);
    for (const int ds : {0, -1, 1})
      for (const int dm : {0, -1, 1}) {
        const int a = s0 + ds, b = m0 + dm;
        if (a < 0 || a > 63 || b < 0 || b > 63 || (ds && D == 0.f) || (dm && Dm == 0.f) || best == 0.f) continue;
        const Eval e = grid(x + SUB * j, SUB, D * a, -(Dm * b), u);
        if (e.err < best) {
          best = e.err;
          sc[j] = static_cast<uint8_t>(a);
          mq[j] = static_cast<uint8_t>(b);
        }
      }
    grid(x + SUB * j, SUB, D * sc[j], -(Dm * mq[j]), q + SUB * j);
  }
  const uint16_t d16 = c10::detail::fp16_ieee_from_fp32_value(D), m16 = c10::detail::fp16_ieee_from_fp32_value(Dm);
  std::memcpy(out, &d16, 2);
  std::memcpy(out + 2, &m16, 2);
  uint8_t* scales = out + 4;
  for (int64_t j = 0; j < 4; ++j) {  // ggml's get_scale_min_k4, inverted
    scales[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<uint8_t>(mq[j] | ((mq[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mq[j + 4] & 15) << 4));
  }
  uint8_t* qs = out + 16;
  for (int64_t c = 0; c < 4; ++c)  // 64 values per 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    for (int64_t l = 0; l < 32; ++l) qs[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
}

}  // namespace

// w [M, K] float32 -> u [M, Kp] uint8 in 0..15, d and m [M, Kp / 64] float16 (Kp: K up to a
// multiple of 64; padding inputs get u = 0).
std::vector<torch::Tensor> int4_fit_groups(torch::Tensor w_in) {
  TORCH_CHECK(w_in.device().is_cpu() && w_in.dim() == 2 && w_in.scalar_type() == torch::kFloat32,
              "int4_fit_groups: w is not a CPU float32 [M, K]");
  const auto w = w_in.contiguous();
  const int64_t M = w.size(0), K = w.size(1), G = (K + GROUP - 1) / GROUP, Kp = G * GROUP;
  auto u = torch::zeros({M, Kp}, torch::kUInt8);
  auto d = torch::empty({M, G}, torch::kFloat16), m = torch::empty({M, G}, torch::kFloat16);
  const float* wp = w.data_ptr<float>();
  uint8_t* up = u.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  uint16_t* mp = reinterpret_cast<uint16_t*>(m.data_ptr<at::Half>());
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g)
        fit_group(wp + r * K + g * GROUP, std::min(GROUP, K - g * GROUP), up + r * Kp + g * GROUP, dp + r * G + g,
                  mp + r * G + g);
  });
  return {u, d, m};
}

// w [M, K] float32, K a multiple of 256 -> [M, K / 256 * 144] uint8: each row's Q4_K blocks,
// as a GGUF file stores them (fit_q4k).
torch::Tensor int4_fit_q4k(torch::Tensor w_in) {
  TORCH_CHECK(w_in.device().is_cpu() && w_in.dim() == 2 && w_in.scalar_type() == torch::kFloat32,
              "int4_fit_q4k: w is not a CPU float32 [M, K]");
  TORCH_CHECK(w_in.size(1) % 256 == 0, "int4_fit_q4k: K = ", w_in.size(1), " is not a multiple of 256");
  const auto w = w_in.contiguous();
  const int64_t M = w.size(0), B = w.size(1) / 256;
  auto out = torch::empty({M, B * 144}, torch::kUInt8);
  const float* wp = w.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, M * B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fit_q4k(wp + 256 * b, op + 144 * b);
  });
  return out;
}

void bind_int4_fit_rows(pybind11::module& m) {
  m.def("int4_fit_q4k", &int4_fit_q4k, "int4's Q4_K blocks (ggml's layout) of a float matrix, fitted per sub-block of 32");
  m.def("int4_fit_groups", &int4_fit_groups, "int4's weight grid per group of 64, fitted by least squares");
}
