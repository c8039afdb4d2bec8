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
// With 3+ tokens the dot products take long enough that the hardware prefetcher falls
// behind DRAM: ask for each block's weights 2 KB (32 groups) ahead into L2. Measured on
// the 1.5B's layer shapes, interleaved runs: 6 tokens 1.24x -> 1.05x one token's time.
constexpr int64_t PREFETCH_GROUPS = 32;
constexpr int PREFETCH_MIN_TOKENS = 3;

// acc[b * TB + t] += <activations of token t, weights of output block b> over all of K.
template <int TB>
static inline void chunk_dots(const uint8_t* q, int64_t Kp, const int8_t* w, int64_t G, int32_t* out) {
#ifdef FORERUN_VNNI
  __m512i acc[CHUNK_BLOCKS][TB];
  for (int b = 0; b < CHUNK_BLOCKS; ++b)
    for (int t = 0; t < TB; ++t) acc[b][t] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[CHUNK_BLOCKS];
    if (TB >= PREFETCH_MIN_TOKENS)  // past a block's end this reads the next one's (or the next chunk's)
      for (int b = 0; b < CHUNK_BLOCKS; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + (b * G + g + PREFETCH_GROUPS) * 64), _MM_HINT_T1);
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

void rms_norm_row(const float* r, const float* w, int64_t K, double eps, float* out) {  // for int4_rows.cpp
  norm_row(r, w, K, eps, out);
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

// max |r[k]| over a row. Any order gives the same float (max is exact), so AVX512 may do it.
static inline float max_abs(const float* r, int64_t K) {
  float s = 0.f;
  int64_t k = 0;
#ifdef FORERUN_VNNI
  __m512 m = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
  s = _mm512_reduce_max_ps(m);
#endif
  for (; k < K; ++k) s = std::max(s, std::fabs(r[k]));
  return s;
}

// Step 1-2 for one row: q[k] = clamp(nearbyint(fma(r[k] / s, inv, zero)), 0, 255). Each element's
// division, fused multiply-add and round-to-nearest-even are exact IEEE operations, so the
// 16-wide loop gives the scalar loop's bytes.
static inline void quantize_row(const float* r, int64_t K, float s, float inv, int32_t zero, uint8_t* q) {
  int64_t k = 0;
#ifdef FORERUN_VNNI
  const __m512 sv = _mm512_set1_ps(s), iv = _mm512_set1_ps(inv), zv = _mm512_set1_ps(static_cast<float>(zero));
  const __m512 lo = _mm512_setzero_ps(), hi = _mm512_set1_ps(255.f);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_fmadd_ps(_mm512_div_ps(_mm512_loadu_ps(r + k), sv), iv, zv);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
  }
#endif
  for (; k < K; ++k) {
    const float v = std::nearbyint(std::fma(r[k] / s, inv, static_cast<float>(zero)));  // fbgemm: fma, then round
    q[k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, v)));
  }
}

// Step 0-2 of the numerics above for N rows of K floats: q [N, Kp] (padding left as it
// is), row_max [N].
// Rows are independent, so several run on separate threads with the same bits.
void quantize_rows(const float* xp, int64_t N, int64_t K, int64_t Kp, const float* nw, double eps, float inv,
                   int32_t zero, uint8_t* q, float* row_max) {
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> normed(nw ? K : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const float* r = xp + i * K;
      if (nw) {
        norm_row(r, nw, K, eps, normed.data());
        r = normed.data();
      }
      const float s = std::max(max_abs(r, K), 1e-12f);
      row_max[i] = s;
      quantize_row(r, K, s, inv, zero, q + i * Kp);
    }
  });
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

bool has_vnni() {
#ifdef FORERUN_VNNI
  return true;
#else
  return false;
#endif
}

torch::Tensor f32_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor bias, int64_t M);  // f32_rows.cpp
torch::Tensor attend_prefix(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows, torch::Tensor limits,
                            double scale);  // attention_rows.cpp
torch::Tensor attend_masked(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows, torch::Tensor mask,
                            double scale);  // attention_rows.cpp
torch::Tensor rope_write_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                                torch::Tensor rows, torch::Tensor slots, int64_t heads, int64_t kv_heads,
                                double scale);  // attention_rows.cpp
torch::Tensor int4_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                        torch::Tensor bias, torch::Tensor norm_w, double eps, int64_t M);  // int4_rows.cpp
void bind_layer_rows(pybind11::module& m);  // layer_rows.cpp
void bind_gguf_rows(pybind11::module& m);   // gguf_rows.cpp
void bind_gguf_packed_rows(pybind11::module& m);  // gguf_packed_rows.cpp

// What this build was made from (kernel_key.py passes them as -D hex tokens; int8_kernel.py
// reuses a build only while they match its sources, torch, -march and CPU).
#define FORERUN_STR_(x) #x
#define FORERUN_STR(x) FORERUN_STR_(x)
#ifndef FORERUN_BUILD_KEY
#define FORERUN_BUILD_KEY none
#define FORERUN_BUILD_SOURCES none
#define FORERUN_BUILD_CPU none
#endif

// The one module of all the *_rows.cpp files (compiled together: setup.py at install, or
// int8_kernel.py at run time). A new file binds its functions in a `void bind_<file>(pybind11::module& m)`
// of its own, declared and called here, as layer_rows.cpp and gguf_rows.cpp do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_rows", &f32_rows, "float32 linear, one FMA chain per output: the same bits for any number of rows");
  m.def("int8_rows", &int8_rows, "per-token int8 linear for a few rows");
  m.def("int4_rows", &int4_rows, "linear over 4-bit group-quantised weights, activations int8 per group, any number of rows");
  m.def("rms_norm_rows", &rms_norm_rows, "the folded RMSNorm of int8_rows, on its own");
  m.def("attend_prefix", &attend_prefix, "attention over key prefixes, one query at a time");
  m.def("attend_masked", &attend_masked, "attention under a mask (token trees), one query at a time, a chain's bits");
  m.def("rope_write_attend", &rope_write_attend, "RoPE, KV cache write and chain attention of a layer, in one call");
  m.def("has_vnni", &has_vnni, "whether the dot product was compiled with AVX512-VNNI");
  bind_layer_rows(m);
  bind_gguf_rows(m);
  bind_gguf_packed_rows(m);
  m.attr("BUILD_KEY") = FORERUN_STR(FORERUN_BUILD_KEY);
  m.attr("BUILD_SOURCES") = FORERUN_STR(FORERUN_BUILD_SOURCES);
  m.attr("BUILD_CPU") = FORERUN_STR(FORERUN_BUILD_CPU);
}
