// int8 linear for a few tokens (decoding, verifying a draft): one call instead of six ops.
//
// Same numerics as forerun's fbgemm path (models/quant.py), bit for bit:
//   0. optionally x = rms_norm(x) * norm_w first (the RMSNorm that feeds this linear);
//   1. each token row x is divided by its own max |x| (float division, as torch.div);
//   2. quantised to uint8 the way fbgemm's Quantize does: nearbyint(x * (1 / scale)) + zero,
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
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FORERUN_VNNI 1
#endif

// acc[r] = <a, b_r> for R weight rows b_0..b_{R-1} (R independent streams keep more loads in flight).
template <int R>
static inline void dots_u8s8(const uint8_t* a, const int8_t* const* b, int64_t K, int32_t* acc) {
#ifdef FORERUN_VNNI
  __m512i v[R];
  for (int r = 0; r < R; ++r) v[r] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i va = _mm512_loadu_si512(a + k);
    for (int r = 0; r < R; ++r) v[r] = _mm512_dpbusd_epi32(v[r], va, _mm512_loadu_si512(b[r] + k));
  }
  if (k < K) {
    const __mmask64 m = (~0ULL) >> (64 - (K - k));
    const __m512i va = _mm512_maskz_loadu_epi8(m, a + k);
    for (int r = 0; r < R; ++r) v[r] = _mm512_dpbusd_epi32(v[r], va, _mm512_maskz_loadu_epi8(m, b[r] + k));
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_epi32(v[r]);
#else
  for (int r = 0; r < R; ++r) {
    int32_t s = 0;
    for (int64_t k = 0; k < K; ++k) s += int32_t(a[k]) * int32_t(b[r][k]);
    acc[r] = s;
  }
#endif
}

// x [..., K] float32, w [M, K] int8, w_scale [M] float32, colsum [M] int32, bias [M] or empty,
// norm_w [K] or empty (no RMSNorm), eps -> [..., M] float32.
torch::Tensor int8_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor w_scale, torch::Tensor colsum,
                        torch::Tensor bias, torch::Tensor norm_w, double eps, double x_scale, int64_t x_zero) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.size(1) == x_in.size(-1),
              "w: contiguous int8 [M, K] with K = x's last dimension");
  const auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K, M = w.size(0);
  const float xs = static_cast<float>(x_scale), inv = 1.0f / xs;
  const int32_t zero = static_cast<int32_t>(x_zero);
  TORCH_CHECK(norm_w.numel() == 0 || norm_w.numel() == K, "norm_w: [K] or empty");
  const float* xp = x.data_ptr<float>();
  const float* nw = norm_w.numel() ? norm_w.data_ptr<float>() : nullptr;
  std::vector<uint8_t> q(N * K);
  std::vector<float> row_max(N);
  std::vector<float> normed(nw ? K : 0);
  for (int64_t i = 0; i < N; ++i) {
    const float* r = xp + i * K;
    if (nw) {
      double ss = 0.0;
      for (int64_t k = 0; k < K; ++k) ss += double(r[k]) * r[k];
      const float inv_rms = static_cast<float>(1.0 / std::sqrt(ss / K + eps));
      for (int64_t k = 0; k < K; ++k) normed[k] = (r[k] * inv_rms) * nw[k];
      r = normed.data();
    }
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s = std::max(s, std::fabs(r[k]));
    s = std::max(s, 1e-12f);
    row_max[i] = s;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint((r[k] / s) * inv) + zero;
      q[i * K + k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, v)));
    }
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  auto out = torch::empty(out_shape, x.options());
  float* op = out.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const int32_t* csp = colsum.data_ptr<int32_t>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  auto finish = [&](int64_t i, int64_t j, int32_t acc) {
    float y = static_cast<float>(acc - zero * csp[j]) * (xs * wsp[j]) * row_max[i];
    op[i * M + j] = bp ? y + bp[j] : y;
  };
  at::parallel_for(0, M, 64, [&](int64_t j0, int64_t j1) {
    constexpr int R = 4;
    int64_t j = j0;
    for (; j + R <= j1; j += R) {  // R weight rows at a time; they stay in L1 across the tokens
      const int8_t* rows[R];
      for (int r = 0; r < R; ++r) rows[r] = wp + (j + r) * K;
      for (int64_t i = 0; i < N; ++i) {
        int32_t acc[R];
        dots_u8s8<R>(q.data() + i * K, rows, K, acc);
        for (int r = 0; r < R; ++r) finish(i, j + r, acc[r]);
      }
    }
    for (; j < j1; ++j) {
      const int8_t* row = wp + j * K;
      for (int64_t i = 0; i < N; ++i) {
        int32_t acc;
        dots_u8s8<1>(q.data() + i * K, &row, K, &acc);
        finish(i, j, acc);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_rows", &int8_rows, "per-token int8 linear for a few rows");
  m.def("has_vnni", &has_vnni, "whether the dot product was compiled with AVX512-VNNI");
}
