// A whole decoder layer of the int8 / int4 / gguf models for a chain of a few tokens, in one call.
//
// Decoding a small model spends a fifth of each forward between its kernels: a dozen
// Python-level calls per layer (module dispatch, chunk, silu, mul, two residual adds), each
// a few microseconds, 24-28 times a forward. This runs the same ops from C++:
//   h = x + o(rope_write_attend(qkv(x)));   out = h + down(silu(gate) * up), gate_up(h) = [gate | up]
// with the RMSNorms already folded into the qkv and gate_up kernels (absorb_norm). Every op is
// the one the Python layer calls (the same kernels, silu_mul_rows, an IEEE add for each
// residual), so the bits are the op-by-op path's: tests/test_int8_identity.py checks it.
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// One Int8Linear / Int4Linear / GGUFLinear's kernel and its arguments, bound once (linears/int8.py,
// linears/int4.py, linears/gguf.py). int8: a = w_scale (b unused, empty); int4: a = d, b = m (their
// kernels' argument order). gguf: the parts, their types and row counts; the RMSNorm that
// feeds it (if any) runs first as rms_norm_rows, as GGUFLinear.forward calls it.
struct KernelLinear {
  enum Kind { INT8, INT4, GGUF_ROWS, GGUF_PACKED } kind;
  torch::Tensor w, a, b, bias, norm_w;
  double eps;
  int64_t M;
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> types, rows;

  KernelLinear(bool int4, torch::Tensor w, torch::Tensor a, torch::Tensor b, torch::Tensor bias, torch::Tensor norm_w,
               double eps, int64_t M)
      : kind(int4 ? INT4 : INT8), w(w), a(a), b(b), bias(bias), norm_w(norm_w), eps(eps), M(M) {}

  static KernelLinear gguf(bool packed, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                           std::vector<int64_t> rows, torch::Tensor bias, torch::Tensor norm_w, double eps) {
    KernelLinear k(false, {}, {}, {}, bias, norm_w, eps, 0);
    k.kind = packed ? GGUF_PACKED : GGUF_ROWS;
    k.parts = std::move(parts);
    k.types = std::move(types);
    k.rows = std::move(rows);
    return k;
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case INT4: return int4_rows(x, w, a, b, bias, norm_w, eps, M);
      case INT8: return int8_rows(x, w, a, bias, norm_w, eps);
      default: {
        const auto xn = norm_w.numel() ? rms_norm_rows(x, norm_w, eps) : x;
        return kind == GGUF_PACKED ? gguf_packed_rows(xn, parts, types, rows, bias) : gguf_rows(xn, parts, types, bias);
      }
    }
  }
};

// exp(x) as 2^n p(r): n = round(x log2 e), r = x - n ln 2 in two FMA steps, p Cephes' degree-6
// polynomial (about 1 ulp on the range silu meets). silu_mul1 is the definition; the vector
// forms run its IEEE operations lane for lane (AVX-512: 16 lanes, 2^n by scalef; AVX2: 8 lanes,
// 2^n as two exact powers of two, so the product rounds once, as ldexp does) and give its bits:
// tests/test_int8_identity.py holds each to it bit for bit. Every element of a build takes the
// same path (a masked tail, never a scalar one), so a token's values never depend on where in a
// row or a batch it sits.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_C1 = 0.693359375f, EXP_C2 = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

static inline float silu_mul1(float g, float u) {
  const float x = std::fmin(std::fmax(-g, -104.f), 89.f);  // where float's exp goes from 0 to inf
  const float n = std::nearbyint(x * EXP_LOG2E);
  float r = std::fma(-n, EXP_C1, x);
  r = std::fma(-n, EXP_C2, r);
  float p = EXP_P[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, EXP_P[i]);
  const float y = std::fma(p * r, r, r) + 1.f;  // p r^2 + r + 1
  return g / (1.f + std::ldexp(y, static_cast<int>(n))) * u;
}

#ifdef __AVX512F__
#define FORERUN_SILU_LANES 16
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  // max / min return their second operand where the first is NaN: fmax's and fmin's choice here
  const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  const __m512 x = _mm512_min_ps(_mm512_max_ps(neg, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C1), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C2), r);
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512 e = _mm512_scalef_ps(y, n);  // y 2^n, one rounding: inf past float's range, 0 below it
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define FORERUN_SILU_LANES 8
static inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg = _mm256_xor_ps(g, _mm256_set1_ps(-0.f));
  const __m256 x = _mm256_min_ps(_mm256_max_ps(neg, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  // y 2^n with n in [-150, 128]: y 2^n1 (n1 = n >> 1, in [-75, 64]) is exact, as y is in
  // [0.7, 1.5]; times 2^(n - n1) it rounds once, to a subnormal, 0 or inf where ldexp does
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 e = _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#else
#define FORERUN_SILU_LANES 1
#endif

// gu [..., 2I] float32, gate_up's [gate | up] -> [..., I]: silu(gate) * up, in one pass over
// both threads (at::silu and at::mul_ took ~15 us a layer on the main thread, most of it
// dispatch and cache misses right after the weights streamed through). The one-call layer
// and MLP.forward (the op-by-op path) both call this: the same bits either way. `reference`:
// silu_mul1 for every element (the definition the vector forms are held to).
torch::Tensor silu_mul_rows(torch::Tensor gu_in, bool reference) {
  TORCH_CHECK(gu_in.scalar_type() == torch::kFloat32 && gu_in.dim() >= 1 && gu_in.size(-1) % 2 == 0,
              "silu_mul_rows: float32 [..., 2I]");
  const auto gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2;
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gu.options());
  if (out.numel() == 0) return out;  // no rows, or [..., 0]: nothing to compute (and no division by I)
  const int64_t N = gu.numel() / (2 * I), V = (I + 15) / 16;
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N * V, 64, [&](int64_t v0, int64_t v1) {  // 16 outputs a step
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t row = v / V, j = (v % V) * 16, n = std::min<int64_t>(16, I - j);
      const float *g = src + row * 2 * I + j, *u = g + I;
      float* o = dst + row * I + j;
      if (reference || FORERUN_SILU_LANES == 1) {
        for (int64_t l = 0; l < n; ++l) o[l] = silu_mul1(g[l], u[l]);
        continue;
      }
#if FORERUN_SILU_LANES == 16
      const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
      _mm512_mask_storeu_ps(o, m, silu_mul16(_mm512_maskz_loadu_ps(m, g), _mm512_maskz_loadu_ps(m, u)));
#elif FORERUN_SILU_LANES == 8
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t h = 0; h < n; h += 8) {  // lanes past n masked off: no load, no store
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - h)), lane);
        _mm256_maskstore_ps(o + h, m, silu_mul8(_mm256_maskload_ps(g + h, m), _mm256_maskload_ps(u + h, m)));
      }
#endif
    }
  });
  return out;
}

// out += x, element by element (at::add_'s values: one IEEE add each), without a dispatch.
static torch::Tensor& add_rows_(torch::Tensor& out, const torch::Tensor& x) {
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "add_rows_: same shapes, float32");
  const auto xc = x.contiguous();
  float* o = out.data_ptr<float>();
  const float* a = xc.data_ptr<float>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) o[i] += a[i];
  return out;
}

// x [B, T, C] float32 -> [B, T, C]; the attention arguments as rope_write_attend takes them.
torch::Tensor decoder_layer_rows(torch::Tensor x, const KernelLinear& qkv, const KernelLinear& o,
                                 const KernelLinear& gate_up, const KernelLinear& down, torch::Tensor cos,
                                 torch::Tensor sin, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                                 torch::Tensor slots, int64_t heads, int64_t kv_heads, double scale,
                                 std::optional<torch::Tensor> tables) {
  // Fresh outputs are added to in place: the same values (float addition commutes), fewer
  // allocations and dispatches.
  auto h = o(rope_write_attend(qkv(x), cos, sin, k, v, rows, slots, heads, kv_heads, scale, tables));
  add_rows_(h, x);
  auto out = down(silu_mul_rows(gate_up(h), false));
  return add_rows_(out, h);
}

// A decoder's layers, each as decoder_layer_rows runs it, from one call: between 24-28 layer
// calls from Python a few-token forward spends about a millisecond (module dispatch, argument
// conversion), an eighth of the 0.5B drafter's. The linears are bound once (copies of their
// KernelLinears: tensor handles); the cache's K / V lists (and a paged pool's block tables, one
// for every layer) and the chain's rows come per call.
struct LayerStack {
  std::vector<KernelLinear> linears;  // per layer: qkv, o, gate_up, down
  int64_t heads, kv_heads;
  double scale;

  LayerStack(std::vector<KernelLinear> linears, int64_t heads, int64_t kv_heads, double scale)
      : linears(std::move(linears)), heads(heads), kv_heads(kv_heads), scale(scale) {
    TORCH_CHECK(this->linears.size() % 4 == 0, "LayerStack: four linears a layer");
  }

  torch::Tensor operator()(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k,
                           const std::vector<torch::Tensor>& v, torch::Tensor rows, torch::Tensor slots,
                           std::optional<torch::Tensor> tables) const {
    const size_t n = linears.size() / 4;
    TORCH_CHECK(k.size() == n && v.size() == n, "LayerStack: one K and one V cache per layer");
    for (size_t i = 0; i < n; ++i) {
      const KernelLinear* l = &linears[4 * i];
      x = decoder_layer_rows(x, l[0], l[1], l[2], l[3], cos, sin, k[i], v[i], rows, slots, heads, kv_heads, scale, tables);
    }
    return x;
  }
};

void bind_layer_rows(pybind11::module& m) {
  pybind11::class_<KernelLinear>(m, "KernelLinear")
      .def(pybind11::init<bool, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double,
                          int64_t>())
      .def_static("gguf", &KernelLinear::gguf, "a GGUFLinear's call: packed or row kernel, optional RMSNorm first")
      .def("__call__", &KernelLinear::operator(), ReleaseGil());
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<std::vector<KernelLinear>, int64_t, int64_t, double>())
      .def("__call__", &LayerStack::operator(), "every layer's decoder_layer_rows in turn", ReleaseGil(), pybind11::arg("x"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("rows"),
           pybind11::arg("slots"), pybind11::arg("tables") = pybind11::none());
  m.def("silu_mul_rows", &silu_mul_rows, "silu(gate) * up of gate_up's [gate | up], forerun's exp, any number of rows (reference: the scalar definition)",
        pybind11::arg("gate_up"), pybind11::arg("reference") = false);
  namespace py = pybind11;
  m.def("decoder_layer_rows", &decoder_layer_rows, "a chain's int8 / int4 / gguf decoder layer in one call (the same bits)", ReleaseGil(),
        py::arg("x"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("cos"), py::arg("sin"),
        py::arg("k"), py::arg("v"), py::arg("rows"), py::arg("slots"), py::arg("heads"), py::arg("kv_heads"),
        py::arg("scale"), py::arg("tables") = py::none());
}
