// What forerun's kernel sources share: every function one source calls in another, and the
// bind_<file> functions module.cpp calls to put each source's functions in the one module.
// Declared here once (build_key.py counts this header in a build's key: an edit rebuilds).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// int8_rows.cpp
torch::Tensor int8_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias,
                        torch::Tensor norm_w, double eps);
torch::Tensor rms_norm_rows(torch::Tensor x_in, torch::Tensor w, double eps);
bool has_vnni();

// int4_rows.cpp
torch::Tensor int4_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor d, torch::Tensor m, torch::Tensor bias,
                        torch::Tensor norm_w, double eps, int64_t M, bool reference = false);
std::string int4_isa();
bool set_int4_paired(bool on);  // benchmark switch (AVX2): 3-8 tokens both halves per pass; returns the old value

// f32_rows.cpp
torch::Tensor f32_rows(torch::Tensor x_in, torch::Tensor w, torch::Tensor bias, int64_t M);

// gguf_rows.cpp
torch::Tensor gguf_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                        torch::Tensor bias);
float gguf_decode_block(int64_t type, const uint8_t* p, uint8_t* q, int16_t* sc, int16_t* mn);

// gguf_packed_rows.cpp
torch::Tensor gguf_packed_rows(torch::Tensor x_in, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                               std::vector<int64_t> rows, torch::Tensor bias, bool reference = false);

// attention_rows.cpp (tables: a paged pool's block tables [rows, width]; none: k, v are rows)
torch::Tensor attend_prefix(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows, torch::Tensor limits,
                            double scale, std::optional<torch::Tensor> tables);
torch::Tensor attend_masked(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows, torch::Tensor mask,
                            double scale, std::optional<torch::Tensor> tables);
torch::Tensor rope_write_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                                torch::Tensor rows, torch::Tensor slots, int64_t heads, int64_t kv_heads, double scale,
                                std::optional<torch::Tensor> tables);

bool set_attention_reference(bool on);  // test switch: every query through the plain C++ definition; returns the old value

// Each source's Python bindings (module.cpp calls them all). The compute calls release the GIL
// while they run (ReleaseGil()): a layer stack holds a chunk of prefill for ~0.5 s, and with the
// GIL held the server's event loop could not send a stream's token until the next chunk had run
// too (a 6k-token newcomer's chunks put 1.0-1.2 s gaps into a running stream instead of ~0.55 s,
// scripts/prefill_gap.py). They touch no Python object; arguments and results are converted with
// the GIL held.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;
void bind_int8_rows(pybind11::module& m);
void bind_layer_rows(pybind11::module& m);
void bind_gguf_rows(pybind11::module& m);
void bind_gguf_packed_rows(pybind11::module& m);
void bind_int4_fit_rows(pybind11::module& m);
