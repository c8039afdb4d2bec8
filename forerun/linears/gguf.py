"""dtype "gguf": a model that computes with its GGUF file's own quantized blocks.

Why: every other precision changes the weights the user downloaded. float32 dequantizes the
file exactly but streams 4-8x the bytes; int8 / int4 re-quantize weights that were already
quantized (Qwen2.5-Coder-1.5B Q4_K_M: +0.19% / +1.04% perplexity since 2026-12-04; +1.7% / +4.6%
at first). Here every linear keeps the
file's blocks byte for byte (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; ggml's layouts,
gguf_rows.cpp) and the activations are quantized per block of the weight's width, as
llama.cpp does: the model llama.cpp runs, at its fidelity.

The blocks are placed in a model by gguf/place.py. Where the
kernels have AVX512-VNNI or AVX2, every linear has its rows rearranged 16 per tile
(gguf_packed_rows.cpp: 16 outputs per VNNI instruction, or 8 per AVX2 maddubs / madd pair, the
same bits on both); elsewhere, or with FORERUN_GGUF_ROWS=1, the linears read the file's
row-major blocks (gguf_rows.cpp). The
embedding table is read from its blocks too, one looked-up row at a time. Tensors of other
types (float norms and biases, a float or unsupported-type matrix) are dequantized to
float32 exactly as the float32 path does. Each token's output is one instruction sequence
whatever else is computed beside it, so `gguf` speculative decoding reproduces `gguf` plain
decoding bit for bit (tests/test_gguf_native.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from forerun.errors import ModelLoadError
from forerun.kernels import loader as kernel_loader

# ggml type ids (gguf.GGMLQuantizationType) with a native kernel -> (values, bytes) per block.
NATIVE_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                12: (256, 144), 13: (256, 176), 14: (256, 210)}


# Types the packed kernel (gguf_packed_rows.cpp) rearranges 16 rows at a time: every native
# type. The bulk of a Q4_K_M file (Q4_K, and the Q6_K of its attn_v, ffn_down and output head),
# a Q5_K_M file's Q5_K, and the legacy 32-value types a file falls back to where a matrix's
# inputs are not whole blocks of 256 (Qwen2.5-0.5B's 896: Q5_0 / Q8_0; SmolLM2's 576: Q4_1).
Q4_K, Q6_K = 12, 14
PACKED_TYPES = set(NATIVE_TYPES)


@dataclass(frozen=True)
class Blocks:
    """One quantized matrix as the file stores it: data [rows, bytes per row] uint8, the
    blocks of each output row in input order; type a ggml type id in NATIVE_TYPES. Packed
    (`packed_rows` > 0): the same bytes rearranged 16 rows per tile, data [ceil(rows / 16),
    K / qk * tile-block bytes] (gguf_packed_rows.cpp), for the VNNI kernel."""

    data: torch.Tensor  # [rows, K / qk * bytes] uint8, or packed [ceil(rows / 16), ...]
    type: int
    in_features: int
    packed_rows: int = 0  # > 0: packed, with this many rows

    @property
    def rows(self) -> int:
        return self.packed_rows or self.data.shape[0]

    def select(self, ids: torch.Tensor) -> "Blocks":
        ids = ids.to(torch.long)
        if self.packed_rows:
            return Blocks(kernels().gguf_packed_select(self.data, self.type, ids, self.in_features), self.type,
                          self.in_features, len(ids))
        return Blocks(self.data.index_select(0, ids).contiguous(), self.type, self.in_features)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[len(ids) or rows, K] float32: the values the kernel computes with (ggml's dequantization)."""
        ids = (torch.arange(self.rows) if ids is None else ids).to(torch.long)
        if self.packed_rows:
            return kernels().gguf_packed_dequant(self.data, self.type, ids, self.in_features)
        return kernels().gguf_dequant_rows(self.data, self.type, ids, self.in_features)

    def pack(self) -> "Blocks":
        """These blocks packed for the VNNI kernel (the same bits, rearranged); itself if packed."""
        if self.packed_rows:
            return self
        return Blocks(kernels().gguf_pack(self.data, self.type, self.in_features), self.type, self.in_features,
                      self.rows)


def packed_simd() -> bool:
    """Whether the packed kernel was compiled with SIMD instructions (AVX512-VNNI, or AVX2 with
    FMA and F16C; the same bits either way). Without them it is plain C++, and the row kernel
    is faster."""
    kernel = kernels()
    return hasattr(kernel, "gguf_packed_isa") and kernel.gguf_packed_isa() != "scalar"


def packs(parts: list[Blocks]) -> bool:
    """Whether a linear of these parts runs on the packed kernel: all of a packed type, a
    kernel with SIMD (packed_simd) and no FORERUN_GGUF_ROWS."""
    return packed_simd() and not os.environ.get("FORERUN_GGUF_ROWS") and all(p.type in PACKED_TYPES for p in parts)


def kernels():
    kernel = kernel_loader.load()
    if kernel is None or not hasattr(kernel, "gguf_rows"):
        raise ModelLoadError("dtype 'gguf' needs forerun's compiled kernels, which are not available here "
                             "(see the warning above; `make setup` builds them); use float32")
    return kernel


class GGUFLinear(nn.Module):
    """nn.Linear's function over GGUF blocks: parts stacked along the outputs (a fused q/k/v
    or gate/up may mix types, e.g. Q4_K q and k with a Q6_K v), one kernel call."""

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFLinear: parts with different input widths")
        self.pre_norm = None  # an RMSNorm run first (see absorb_norm)
        self.packed = packs(parts)
        self.parts = [p.pack() for p in parts] if self.packed else parts
        if not self.packed and any(p.packed_rows for p in parts):
            raise ValueError("GGUFLinear: packed blocks need the packed kernel (AVX512-VNNI or AVX2) and packed types only")
        self.in_features, self.out_features = parts[0].in_features, sum(p.rows for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self._bind()

    def _bind(self):
        """The kernel call (gguf_packed_rows or gguf_rows, the absorbed RMSNorm first), its
        arguments bound once in C++ (KernelLinear): what forward and a decoder layer's one C++
        call (layer_rows.cpp) both run."""
        kernel, bias = kernels(), self.bias.data if self.bias is not None else torch.empty(0)
        norm = self.pre_norm
        norm_w, eps = (norm.weight.data, float(norm.eps)) if norm is not None else (torch.empty(0), 0.0)
        self.kernel_linear = kernel.KernelLinear.gguf(self.packed, [p.data for p in self.parts],
                                                      [p.type for p in self.parts], [p.rows for p in self.parts],
                                                      bias, norm_w, eps)

    def absorb_norm(self, norm: nn.Module) -> bool:
        """Compute linear(norm(x)) from here on, the RMSNorm run by the kernels' rms_norm_rows
        just before this linear's kernel, both inside the one bound call (kernel_linear) that
        forward and the layer's C++ call use: the caller drops its own call to `norm`. False
        (nothing changed) for a norm other than a float32 RMSNorm (Gemma's keep theirs)."""
        if type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
            return False
        self.pre_norm = norm
        self._bind()
        return True

    def __getstate__(self):  # deepcopy / pickle: drop the compiled call...
        return {**self.__dict__, "kernel_linear": None}

    def __setstate__(self, state):  # ...and find it again
        super().__setstate__(state)
        self._bind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x if dtype == torch.float32 else x.float()
        y = self.kernel_linear(x)
        return y if dtype == torch.float32 else y.to(dtype)

    def float_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in] float32 weights of the given output rows."""
        out = torch.empty(len(ids), self.in_features)
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.rows)
            if mine.any():
                out[mine] = p.dequantize(ids[mine] - start)
            start += p.rows
        return out

    def select_rows(self, ids: torch.Tensor) -> "GGUFLinear":
        """A GGUFLinear of the given output rows (the same blocks): a reduced LM head."""
        if len(self.parts) != 1:
            raise ValueError("select_rows: a single-part GGUFLinear only")
        bias = None if self.bias is None else self.bias.data[ids]
        return GGUFLinear([self.parts[0].select(ids)], bias)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] float32, dequantized on demand (a copy: for building other models from this one)."""
        return self.float_rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        types = "+".join(_type_name(p.type) for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, GGUF {types} blocks, forerun kernel"


class GGUFEmbedding(nn.Module):
    """nn.Embedding over GGUF blocks: each looked-up row dequantized exactly when looked up."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.rows, blocks.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        try:  # the kernel checks every id: no passes over them here (two reductions a forward)
            rows = self.blocks.dequantize(ids.reshape(-1))
        except RuntimeError as e:
            if "out of range" not in str(e):
                raise
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows") from None
        return rows.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """[rows, dim] float32, dequantized on demand (a copy)."""
        return self.blocks.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {_type_name(self.blocks.type)} blocks"


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t).name
