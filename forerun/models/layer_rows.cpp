// A whole decoder layer of the int8 / int4 / gguf models for a chain of a few tokens, in one call.
//
// Decoding a small model spends a fifth of each forward between its kernels: a dozen
// Python-level calls per layer (module dispatch, chunk, silu, mul, two residual adds), each
// a few microseconds, 24-28 times a forward. This runs the same ops from C++:
//   h = x + o(rope_write_attend(qkv(x)));   out = h + down(silu(gate) * up), gate_up(h) = [gate | up]
// with the RMSNorms already folded into the qkv and gate_up kernels (absorb_norm). Every op is
// the one the Python layer calls (the same kernels, at::add / at::silu / at::mul on the same
// views), so the bits are the op-by-op path's: tests/test_int8_identity.py checks it.
#include <torch/extension.h>

torch::Tensor int8_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias,
                        torch::Tensor norm_w, double eps);
torch::Tensor int4_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor m, torch::Tensor bias,
                        torch::Tensor norm_w, double eps, int64_t M);
torch::Tensor gguf_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                        torch::Tensor bias);  // gguf_rows.cpp
torch::Tensor gguf_packed_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                               std::vector<int64_t> rows, torch::Tensor bias);  // gguf_packed_rows.cpp
torch::Tensor rms_norm_rows(torch::Tensor x_in, torch::Tensor w, double eps);  // int8_rows.cpp
torch::Tensor rope_write_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                                torch::Tensor rows, torch::Tensor slots, int64_t heads, int64_t kv_heads, double scale);

// One Int8Linear / Int4Linear / GGUFLinear's kernel and its arguments, bound once (quant.py,
// quant4.py, gguf_native.py). int8: a = w_scale (b unused, empty); int4: a = d, b = m (their
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

// x [B, T, C] float32 -> [B, T, C]; the attention arguments as rope_write_attend takes them.
torch::Tensor decoder_layer_rows(torch::Tensor x, const KernelLinear& qkv, const KernelLinear& o,
                                 const KernelLinear& gate_up, const KernelLinear& down, torch::Tensor cos,
                                 torch::Tensor sin, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                                 torch::Tensor slots, int64_t heads, int64_t kv_heads, double scale) {
  // Fresh outputs are added to in place and gate / up are narrowed, not chunked: the same
  // values (float addition commutes), fewer allocations and dispatches.
  const auto h = o(rope_write_attend(qkv(x), cos, sin, k, v, rows, slots, heads, kv_heads, scale)).add_(x);
  const auto gu = gate_up(h);
  const int64_t inter = gu.size(-1) / 2;
  return down(at::silu(gu.narrow(-1, 0, inter)).mul_(gu.narrow(-1, inter, inter))).add_(h);
}

// A decoder's layers, each as decoder_layer_rows runs it, from one call: between 24-28 layer
// calls from Python a few-token forward spends about a millisecond (module dispatch, argument
// conversion), an eighth of the 0.5B drafter's. The linears are bound once (copies of their
// KernelLinears: tensor handles); the cache's K / V lists and the chain's rows come per call.
struct LayerStack {
  std::vector<KernelLinear> linears;  // per layer: qkv, o, gate_up, down
  int64_t heads, kv_heads;
  double scale;

  LayerStack(std::vector<KernelLinear> linears, int64_t heads, int64_t kv_heads, double scale)
      : linears(std::move(linears)), heads(heads), kv_heads(kv_heads), scale(scale) {
    TORCH_CHECK(this->linears.size() % 4 == 0, "LayerStack: four linears a layer");
  }

  torch::Tensor operator()(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k,
                           const std::vector<torch::Tensor>& v, torch::Tensor rows, torch::Tensor slots) const {
    const size_t n = linears.size() / 4;
    TORCH_CHECK(k.size() == n && v.size() == n, "LayerStack: one K and one V cache per layer");
    for (size_t i = 0; i < n; ++i) {
      const KernelLinear* l = &linears[4 * i];
      x = decoder_layer_rows(x, l[0], l[1], l[2], l[3], cos, sin, k[i], v[i], rows, slots, heads, kv_heads, scale);
    }
    return x;
  }
};

void bind_layer_rows(pybind11::module& m) {
  pybind11::class_<KernelLinear>(m, "KernelLinear")
      .def(pybind11::init<bool, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double,
                          int64_t>())
      .def_static("gguf", &KernelLinear::gguf, "a GGUFLinear's call: packed or row kernel, optional RMSNorm first")
      .def("__call__", &KernelLinear::operator());
  pybind11::class_<LayerStack>(m, "LayerStack")
      .def(pybind11::init<std::vector<KernelLinear>, int64_t, int64_t, double>())
      .def("__call__", &LayerStack::operator(), "every layer's decoder_layer_rows in turn");
  m.def("decoder_layer_rows", &decoder_layer_rows, "a chain's int8 / int4 / gguf decoder layer in one call (the same bits)");
}
