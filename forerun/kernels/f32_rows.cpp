// float32 linear that streams each weight once for all of a forward's tokens, and gives a
// token the same bits whatever else is in the forward.
//
// torch's sgemm picks its kernel (and its summation order) by the number of rows, and at 2-12
// rows it re-reads weights it could have kept in cache: scoring 8 tokens of a 1.5B model cost
// 2.7x one token. Here every output y[t][j] = sum_k x[t][k] * w[j][k] is ONE fused
// multiply-add chain over k = 0 .. K-1, then + bias, for every N: scoring k drafted tokens
// at once gives each the bits it gets alone (float32 speculative == float32 plain, bit for
// bit, with the per-query attention), and the cost of a forward is the weight stream.
//
// Weights are packed once (`pack_f32_weight` in linears/f32.py) as [Mp/16][K][16]: for each k,
// 16 consecutive outputs' weights are one 64-byte vector. A chunk of 4 such blocks (64
// outputs) is processed for up to 6 tokens at a time (24 accumulators), K in tiles that stay
// in L2 while every token group passes over them; partial sums wait in memory between tiles
// (storing a float does not change it, so the order above holds).
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FORERUN_F32_AVX512 1
#endif

namespace {
constexpr int64_t LANES = 16, BLOCKS = 3, TOKENS = 8, K_TILE = 512;

// acc[(b * TB + t) * 16 + l] += sum over k in [k0, k1) of x[t][k] * w[b][k][l]
template <int TB>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, int64_t k0, int64_t k1, float* acc) {
#ifdef FORERUN_F32_AVX512
  __m512 a[BLOCKS][TB];
  for (int b = 0; b < BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) a[b][t] = _mm512_loadu_ps(acc + (b * TB + t) * LANES);
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) wv[b] = _mm512_loadu_ps(w + (b * K + k) * LANES);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_set1_ps(x[t * ldx + k]);
      for (int b = 0; b < BLOCKS; ++b) a[b][t] = _mm512_fmadd_ps(xv, wv[b], a[b][t]);
    }
  }
  for (int b = 0; b < BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) _mm512_storeu_ps(acc + (b * TB + t) * LANES, a[b][t]);
#else
  for (int b = 0; b < BLOCKS; ++b)
    for (int t = 0; t < TB; ++t)
      for (int l = 0; l < LANES; ++l) {
        float s = acc[(b * TB + t) * LANES + l];
        for (int64_t k = k0; k < k1; ++k) s = std::fma(x[t * ldx + k], w[(b * K + k) * LANES + l], s);
        acc[(b * TB + t) * LANES + l] = s;
      }
#endif
}

template <int TB>
void tile_n(int tb, const float* x, int64_t ldx, const float* w, int64_t K, int64_t k0, int64_t k1, float* acc) {
  if (tb == TB) return tile<TB>(x, ldx, w, K, k0, k1, acc);
  if constexpr (TB > 1) tile_n<TB - 1>(tb, x, ldx, w, K, k0, k1, acc);
}
}  // namespace

// x [..., K] float32; w packed [Mp/16, K, 16] float32 (Mp a multiple of 64); bias [M] or
// empty; M the real output count -> [..., M].
torch::Tensor f32_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor bias, int64_t M) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(2) == LANES &&
              w.size(0) % BLOCKS == 0 && w.size(0) * LANES >= M, "w: packed float32 [Mp/16, K, 16]");
  const auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K, chunks = w.size(0) / BLOCKS;
  TORCH_CHECK(w.size(1) == K, "packed weight's K differs from x's");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == M && bias.scalar_type() == torch::kFloat32), "bias: [M] or empty");
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  auto out = torch::empty(out_shape, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float* bp = bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(N * BLOCKS * LANES);  // [token group][block][token][lane]
    for (int64_t c = c0; c < c1; ++c) {
      const float* wc = wp + c * BLOCKS * K * LANES;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += K_TILE) {
        const int64_t k1 = std::min(K, k0 + K_TILE);
        for (int64_t t0 = 0; t0 < N; t0 += TOKENS) {
          const int tb = static_cast<int>(std::min<int64_t>(TOKENS, N - t0));
          tile_n<TOKENS>(tb, xp + t0 * K, K, wc, K, k0, k1, acc.data() + t0 * BLOCKS * LANES);
        }
      }
      for (int64_t t0 = 0; t0 < N; t0 += TOKENS) {
        const int64_t tb = std::min<int64_t>(TOKENS, N - t0);
        const float* a = acc.data() + t0 * BLOCKS * LANES;
        for (int64_t b = 0; b < BLOCKS; ++b) {
          const int64_t j0 = (c * BLOCKS + b) * LANES;
          const int64_t n = std::min<int64_t>(LANES, M - j0);
          for (int64_t t = 0; t < tb && n > 0; ++t)
            for (int64_t l = 0; l < n; ++l) {
              const float y = a[(b * tb + t) * LANES + l];
              op[(t0 + t) * M + j0 + l] = bp ? y + bp[j0 + l] : y;
            }
        }
      }
    }
  });
  return out;
}
