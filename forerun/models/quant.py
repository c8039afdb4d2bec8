"""int8 linears for the CPU: per-channel weight scales, per-token activation scales.

torch's dynamic int8 linear (fbgemm) picks ONE activation range for the whole input
tensor, so a token's result would depend on the tokens scored beside it. We make the
range per token:
  1. divide each token's row by its own max |x| (every row now spans at most [-1, 1]);
  2. quantise with the uint8 scale / zero point fbgemm picks for exactly [-1, 1] (for
     fbgemm itself: append an anchor row [1, -1, 0, ...] so the tensor's range is [-1, 1]);
  3. int8 GEMM with int32 accumulation (exact) and multiply each row back by its scale.
A token's output is then independent of its batch-mates *given the same input row*.

Three kernels compute those same bits (tested), each where it is fastest on the CPU:
  - a few tokens (decoding, verifying a draft): forerun's compiled kernel (int8_rows.cpp),
    one call per linear; falls back to fbgemm where it cannot be built;
  - many tokens (prefill): oneDNN's int8 GEMM where it gives those bits on this CPU (with
    AMX it does, and is 2-4x fbgemm at 800 tokens; on AVX512-VNNI without AMX its float
    epilogue rounds differently), else the few-token path for every size. The check runs
    once per process (int8_probe.wide_path) and `forerun --version` shows its verdict.
Whole-model identity between scoring one token and several still does not follow: the
float ops before each linear (attention, norms) differ in the last bits between the two
shapes, and a last-bit change that flips one rounding moves the value by a whole
quantisation step. `forerun compare` therefore reports int8's match share, not identity.
"""
from __future__ import annotations

import torch
from torch import nn

from forerun.models import int8_kernel
from forerun.models.int8_gemm import (activation_qparams, fbgemm_anchor, fbgemm_prepack, fbgemm_rows, onednn_rows,
                                         quiet)
from forerun.models.int8_probe import wide_path

WIDE_ROWS = 64  # from this many tokens on, oneDNN's GEMM is the fastest (measured crossover 32-64)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, use_kernel: bool = True):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # [out] per channel
        with quiet():  # deprecated upstream, still the fast fbgemm path in 2.13
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), axis=0, dtype=torch.qint8)
        w8 = qw.int_repr().contiguous()
        self.register_buffer("weight_int8", w8, persistent=False)  # [out, in]
        self.register_buffer("weight_scale", scale.float(), persistent=False)  # [out]
        self.register_buffer("weight_colsum", w8.sum(dim=1, dtype=torch.int32), persistent=False)  # [out]
        self.register_buffer("weight_zero", torch.zeros_like(w8[:, 0], dtype=torch.int32), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("anchor", fbgemm_anchor(self.in_features), persistent=False)
        self.pre_norm = None  # an RMSNorm run first (see absorb_norm)
        self._use_kernel = use_kernel
        self._build_kernels()

    def _build_kernels(self):
        """The kernels' own copies of the weights (opaque handles: rebuilt, not copied or pickled)."""
        kernel = int8_kernel.load() if self._use_kernel else None
        self._kernel = kernel
        self._rows = kernel.int8_rows if kernel is not None else None  # the compiled few-token kernel
        self.weight_packed = pack_weight(self.weight_int8) if kernel is not None else None
        self._packed = None
        if kernel is None:
            self._packed = fbgemm_prepack(self.weight_int8, self.weight_scale)
        self._wide = torch.ops.onednn.qlinear_prepack(self.weight_int8, None) if wide_path() == "onednn" else None
        self._set_rows_args()

    def __getstate__(self):  # deepcopy / pickle: drop the opaque kernel handles...
        state = dict(self.__dict__)
        state.update(_kernel=None, _rows=None, _packed=None, _wide=None, _rows_args=None, kernel_linear=None, weight_packed=None)
        return state

    def __setstate__(self, state):  # ...and rebuild them from the int8 weights
        super().__setstate__(state)
        self._build_kernels()

    def _set_rows_args(self):
        """The kernel's arguments as a plain tuple: nn.Module attribute lookups cost ~1 us each,
        and the hot path makes one call. (int8 is a CPU-only path: these tensors never move.)"""
        if self._rows is None:
            self._rows_args = self.kernel_linear = None
            return
        empty = self.weight_scale[:0]
        bias = self.bias.data if self.bias is not None else empty
        norm_w, eps = (self.pre_norm.weight.data, self.pre_norm.eps) if self.pre_norm is not None else (empty, 0.0)
        self._rows_args = (self.weight_packed, self.weight_scale, self.weight_colsum, bias, norm_w, eps, *activation_qparams())
        # the same call, bound in C++: what a whole-layer kernel call takes (layer_rows.cpp)
        self.kernel_linear = self._kernel.KernelLinear(False, *self._rows_args, self.out_features)

    def absorb_norm(self, norm: nn.Module) -> bool:
        """Compute linear(norm(x)) from here on, the norm inside the few-token kernel (its
        ~40 us of small ops per call is a tenth of an int8 decode step) and, for wide inputs,
        the kernel's rms_norm_rows: the same bits on every path. The caller then drops its
        own call to `norm`. False (nothing changed) without the kernel or for a norm other
        than a float32 RMSNorm."""
        if self._rows is None or type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
            return False
        self.pre_norm = norm
        self._set_rows_args()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.float()
        if self._rows is not None and (x.numel() < WIDE_ROWS * x.shape[-1] or self._wide is None):
            y = self._rows(x, *self._rows_args)  # the hot path: one call, no other op
            return y if dtype == torch.float32 else y.to(dtype)
        if self.pre_norm is not None:
            x = self._kernel.rms_norm_rows(x, self.pre_norm.weight, self.pre_norm.eps)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self._wide_gemm(x2) if x2.shape[0] >= WIDE_ROWS and self._wide is not None else self._fbgemm(x2)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features).to(dtype)

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        return fbgemm_rows(x, self._packed, self.anchor)

    def _wide_gemm(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_rows(x, self._wide, self.weight_scale, self.weight_zero)

    def extra_repr(self) -> str:
        kernel = "forerun kernel" if self._rows is not None else "fbgemm"
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel weights, per-token activations, {kernel}"


def pack_weight(w8: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 -> [Mp/16, Kp/4, 16, 4], the layout int8_rows.cpp reads: 64 bytes hold
    4 consecutive inputs of 16 consecutive outputs (Mp: M up to a multiple of 48, the
    kernel's 3-block chunks; Kp: K up to a multiple of 4; padded with zero weights)."""
    M, K = w8.shape
    Mp, Kp = -(-M // 48) * 48, -(-K // 4) * 4
    padded = torch.zeros(Mp, Kp, dtype=torch.int8)
    padded[:M, :K] = w8
    return padded.view(Mp // 16, 16, Kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def to_int8_(model: nn.Module) -> nn.Module:
    """The int8 model: every linear quantised, then the model's own kernel wiring where it
    has one (LlamaForCausalLM.use_int8_kernels: norms folded, per-query chain attention)."""
    quantize_int8_(model)
    kernel = int8_kernel.load()
    if kernel is not None and hasattr(model, "use_int8_kernels"):
        model.use_int8_kernels(kernel)
    return model


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in place (the LM head included: it is the largest GEMM)."""
    from forerun.models.f32_linear import F32RowsLinear

    for name, child in model.named_children():
        if isinstance(child, (nn.Linear, F32RowsLinear)):  # (a float32 model's kernel linears too)
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model
