// int8 linear, any number of tokens (decoding, verifying a draft, prefill): one call per linear.
//
// Numerics, per token row x and output j:
//   0. optionally x = rms_norm(x) * norm_w first (the RMSNorm that feeds this linear);
//   1. activations int8 with one scale per group of 64 inputs (quantize_groups_rows below,
//      int4_rows.cpp's too: a[k] = nearbyint(x[k] * (127 / amax_g)), s_g = amax_g / 127), as
//      llama.cpp's Q8 activation blocks: one scale per token let a few large channels flatten
//      the rest of the token (the 1.5B: KL from float32 0.022 per token, 0.0014 per group);
//   2. per group, the exact int32 dot product with the per-channel int8 weights w8[j];
//   3. S_j = sum over groups, in order, of fma(float(dp[j, g]), s_g, S_j);
//   4. y_j = S_j * w_scale[j] (+ bias[j]).
// Each token is computed on its own by the same instructions for any number of tokens, so
// its result never depends on its batch-mates (speculative output = plain output).
// The dot product uses AVX512-VNNI when the compiler targets it, plain C++ otherwise.
#include "kernels.h"

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

// Weights are packed once (Int8Linear, `pack_weight` in linears/int8.py) as [M/16][K/4][16][4] bytes
// w8 + 128 (VNNI multiplies unsigned by signed bytes: the weights are the unsigned side, the
// activations the signed one; dp = sum (w8 + 128) a - 128 sum a, exact): 64 bytes = 4
// consecutive k of 16 consecutive outputs, exactly one VNNI instruction's worth. A token's 4
// activation bytes are broadcast to all 16 lanes, so the accumulators hold 16 outputs each and
// need no horizontal sums; one weight load serves up to 4 tokens. M is padded to a multiple
// of 48 and K to one of 64 (zero weights).
constexpr int64_t OUT_BLOCK = 16, CHUNK_BLOCKS = 3, K_GROUP = 4, MAX_TOKENS = 4, GROUP = 64;
constexpr int64_t QUADS = GROUP / K_GROUP;  // 4-input steps per activation group
// With 3+ tokens the dot products take long enough that the hardware prefetcher falls
// behind DRAM: ask for each block's weights 2 KB (32 steps) ahead into L2. Measured on
// the 1.5B's layer shapes, interleaved runs: 6 tokens 1.24x -> 1.05x one token's time.
constexpr int64_t PREFETCH_GROUPS = 32;
constexpr int PREFETCH_MIN_TOKENS = 3;

// out[(b * TB + t) * 16 + l] = S (step 3) for the chunk's 3 output blocks from w (3 blocks of
// [Kq][16][4], Kq = Kp / 4), TB <= 4 tokens (12 int + 12 float accumulators in registers);
// more tokens take further passes, which find the chunk's weights (48 x Kp bytes) in L2.
template <int TB>
static inline void chunk_dots(const int8_t* a, int64_t Kp, const float* sa, const float* sg, const uint8_t* w,
                              float* out) {
  const int64_t Kq = Kp / K_GROUP, G = Kp / GROUP;
#ifdef FORERUN_VNNI
  __m512 facc[CHUNK_BLOCKS][TB];
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) facc[b][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[CHUNK_BLOCKS][TB];
    for (int b = 0; b < CHUNK_BLOCKS; ++b)
      for (int t = 0; t < TB; ++t) acc[b][t] = _mm512_setzero_si512();
    for (int64_t i = 0; i < QUADS; ++i) {
      const int64_t kq = g * QUADS + i;
      if (TB >= PREFETCH_MIN_TOKENS)  // past a block's end this reads the next one's (or the next chunk's)
        for (int b = 0; b < CHUNK_BLOCKS; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(w + (b * Kq + kq + PREFETCH_GROUPS) * 64), _MM_HINT_T1);
      __m512i wv[CHUNK_BLOCKS];
      for (int b = 0; b < CHUNK_BLOCKS; ++b) wv[b] = _mm512_loadu_si512(w + (b * Kq + kq) * 64);
      for (int t = 0; t < TB; ++t) {
        int32_t four;
        std::memcpy(&four, a + t * Kp + kq * K_GROUP, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int b = 0; b < CHUNK_BLOCKS; ++b) acc[b][t] = _mm512_dpbusd_epi32(acc[b][t], wv[b], x);
      }
    }
    for (int t = 0; t < TB; ++t) {
      const __m512i off = _mm512_set1_epi32(128 * static_cast<int32_t>(sa[t * G + g]));
      const __m512 s = _mm512_set1_ps(sg[t * G + g]);
      for (int b = 0; b < CHUNK_BLOCKS; ++b)
        facc[b][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[b][t], off)), s, facc[b][t]);
    }
  }
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + (b * TB + t) * OUT_BLOCK, facc[b][t]);
#else
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t)
      for (int l = 0; l < OUT_BLOCK; ++l) {
        float s = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t dp = 0;
          for (int64_t kq = g * QUADS; kq < (g + 1) * QUADS; ++kq)
            for (int k = 0; k < K_GROUP; ++k)
              dp += int32_t(a[t * Kp + kq * K_GROUP + k]) * int32_t(w[((b * Kq + kq) * OUT_BLOCK + l) * K_GROUP + k]);
          dp -= 128 * static_cast<int32_t>(sa[t * G + g]);
          s = std::fma(static_cast<float>(dp), sg[t * G + g], s);
        }
        out[(b * TB + t) * OUT_BLOCK + l] = s;
      }
#endif
}

// RMSNorm of one row, the folded norm of int8_rows and int4_rows (also exported as
// rms_norm_rows, which the gguf linears call): x * (1 / sqrt(mean(x^2) + eps)) * w.
static inline void norm_row(const float* r, const float* w, int64_t K, double eps, float* out) {
  double ss = 0.0;
  for (int64_t k = 0; k < K; ++k) ss += double(r[k]) * r[k];
  const float inv_rms = static_cast<float>(1.0 / std::sqrt(ss / K + eps));
  for (int64_t k = 0; k < K; ++k) out[k] = (r[k] * inv_rms) * w[k];
}

// One row's activations, per group of 64 (step 1 above): a [Kp] int8, sa, sg [G]. The
// 16-wide loop gives the scalar loop's bytes (max is exact; one IEEE multiply and a
// round-to-nearest-even per element).
static void quantize_groups_row(const float* r, int64_t K, int64_t G, int8_t* a, float* sa, float* sg) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * GROUP, n = std::max<int64_t>(0, std::min<int64_t>(GROUP, K - k0));
    float amax = 0.f;
    for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(r[k0 + k]));
    int8_t* ag = a + k0;
    std::memset(ag, 0, GROUP);
    int32_t sum = 0;
    if (amax > 0.f) {
      const float inv = 127.f / amax;
      int64_t k = 0;
#ifdef FORERUN_VNNI
      const __m512 iv = _mm512_set1_ps(inv);
      for (; k + 16 <= n; k += 16) {
        const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(r + k0 + k), iv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ag + k), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(v)));
      }
#endif
      for (; k < n; ++k) ag[k] = static_cast<int8_t>(std::nearbyint(r[k0 + k] * inv));
      for (k = 0; k < n; ++k) sum += ag[k];
    }
    sa[g] = static_cast<float>(sum);
    sg[g] = amax / 127.f;
  }
}

// Step 0-1 for N rows of K floats (the folded RMSNorm first where nw is given): a [N, Kp],
// sa and sg [N, Kp / 64]. Rows are independent, so several run on separate threads with the
// same bits. Shared with int4_rows.cpp: both kernels see the same activation bytes.
void quantize_groups_rows(const float* xp, int64_t N, int64_t K, int64_t Kp, const float* nw, double eps, int8_t* a,
                          float* sa, float* sg) {
  const int64_t G = Kp / GROUP;
  // a few rows are quicker on this thread than the other's wake-up: threads from 64K values on
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t i0, int64_t i1) {
    std::vector<float> normed(nw ? K : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const float* r = xp + i * K;
      if (nw) {
        norm_row(r, nw, K, eps, normed.data());
        r = normed.data();
      }
      quantize_groups_row(r, K, G, a + i * Kp, sa + i * G, sg + i * G);
    }
  });
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

// x [..., K] float32; w [Mp/16, Kp/4, 16, 4] uint8 (w8 + 128); w_scale, bias (or empty) [M];
// norm_w [K] or empty (no RMSNorm) -> [..., M] float32.
torch::Tensor int8_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias,
                        torch::Tensor norm_w, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == OUT_BLOCK &&
              w.size(3) == K_GROUP && w.size(0) % CHUNK_BLOCKS == 0 && w.size(1) % QUADS == 0,
              "w: packed uint8 [Mp/16, Kp/4, 16, 4], Mp % 48 == 0, Kp % 64 == 0");
  const auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = x.numel() / K, M = w_scale.numel();
  const int64_t Kp = w.size(1) * K_GROUP, G = Kp / GROUP, chunks = w.size(0) / CHUNK_BLOCKS;
  TORCH_CHECK(Kp >= K && Kp < K + GROUP && w.size(0) * OUT_BLOCK >= M, "packed weight does not fit x / w_scale");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && (bias.numel() == 0 || bias.numel() == M), "w_scale, bias: [M]");
  TORCH_CHECK(norm_w.numel() == 0 || norm_w.numel() == K, "norm_w: [K] or empty");
  const float* xp = x.data_ptr<float>();
  const float* nw = norm_w.numel() ? norm_w.data_ptr<float>() : nullptr;
  std::vector<int8_t> act(N * Kp);
  std::vector<float> sa(N * G), sg(N * G);
  quantize_groups_rows(xp, N, K, Kp, nw, eps, act.data(), sa.data(), sg.data());
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  auto out = torch::empty(out_shape, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    float acc[CHUNK_BLOCKS * MAX_TOKENS * OUT_BLOCK];
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t* wc = wp + c * CHUNK_BLOCKS * Kp * OUT_BLOCK;
      for (int64_t t0 = 0; t0 < N; t0 += MAX_TOKENS) {
        const int TB = static_cast<int>(std::min<int64_t>(MAX_TOKENS, N - t0));
        const int8_t* at = act.data() + t0 * Kp;
        const float *st = sa.data() + t0 * G, *gt = sg.data() + t0 * G;
        switch (TB) {
          case 1: chunk_dots<1>(at, Kp, st, gt, wc, acc); break;
          case 2: chunk_dots<2>(at, Kp, st, gt, wc, acc); break;
          case 3: chunk_dots<3>(at, Kp, st, gt, wc, acc); break;
          default: chunk_dots<4>(at, Kp, st, gt, wc, acc); break;
        }
        for (int b = 0; b < CHUNK_BLOCKS; ++b) {  // step 4: y = S * w_scale (+ bias)
          const int64_t j0 = (c * CHUNK_BLOCKS + b) * OUT_BLOCK, n = std::min<int64_t>(OUT_BLOCK, M - j0);
          for (int t = 0; n > 0 && t < TB; ++t) {
            const float* a = acc + (b * TB + t) * OUT_BLOCK;
            float* dst = op + (t0 + t) * M + j0;
            for (int64_t l = 0; l < n; ++l) {
              const float y = a[l] * wsp[j0 + l];
              dst[l] = bp ? y + bp[j0 + l] : y;
            }
          }
        }
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

// The functions of this file and of the sources that module.cpp binds no other way (f32_rows.cpp,
// int4_rows.cpp, attention_rows.cpp), put in the module.
void bind_int8_rows(pybind11::module& m) {
  m.def("f32_rows", &f32_rows, "float32 linear, one FMA chain per output: the same bits for any number of rows", ReleaseGil());
  m.def("int8_rows", &int8_rows, "int8 linear, activations int8 per group of 64, any number of rows", ReleaseGil());
  namespace py = pybind11;
  m.def("int4_rows", &int4_rows, "linear over 4-bit group-quantised weights, activations int8 per group, any number of rows "
        "(reference: the plain C++ definition)", ReleaseGil(), py::arg("x"), py::arg("w"), py::arg("d"), py::arg("m"),
        py::arg("bias"), py::arg("norm_w"), py::arg("eps"), py::arg("M"), py::arg("reference") = false);
  m.def("set_int4_paired", &set_int4_paired, "AVX2: int4_rows takes 3-8 tokens both halves per pass (default) or a half at a time; the same bits");
  m.def("int4_isa", &int4_isa, "the SIMD path int4_rows takes on this build: avx512-vnni, avx2 or scalar");
  m.def("rms_norm_rows", &rms_norm_rows, "the folded RMSNorm of int8_rows, on its own");
  m.def("attend_prefix", &attend_prefix, "attention over key prefixes, one query at a time", ReleaseGil(), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("rows"), py::arg("limits"), py::arg("scale"), py::arg("tables") = py::none());
  m.def("attend_masked", &attend_masked, "attention under a mask (token trees), one query at a time, a chain's bits", ReleaseGil(),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("rows"), py::arg("mask"), py::arg("scale"),
        py::arg("tables") = py::none());
  m.def("set_attention_reference", &set_attention_reference,
        "test switch: attention through its plain C++ definition (the SIMD paths give its bits); returns the old value");
  m.def("rope_write_attend", &rope_write_attend, "RoPE, KV cache write and chain attention of a layer, in one call", ReleaseGil(),
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k"), py::arg("v"), py::arg("rows"), py::arg("slots"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("scale"), py::arg("tables") = py::none());
  m.def("has_vnni", &has_vnni, "whether the dot product was compiled with AVX512-VNNI");
}
