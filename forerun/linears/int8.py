"""int8 linears for the CPU: per-channel weight scales, activations int8 per group of 64 inputs.

Weights: each output row j scaled by max |w[j]| / 127 and rounded to int8 (symmetric).
Activations: each token's row quantized to int8 with one scale per group of 64 inputs
(amax / 127, as llama.cpp's Q8 activation blocks). One scale per token (fbgemm's dynamic
quantization, forerun's int8 until 2026-12-04) let a few large channels flatten the rest of
the token: on Qwen2.5-Coder-1.5B its KL from float32 was 0.022 (+1.7% perplexity); per group
of 64 it is about 0.001.

One compiled kernel computes every size (int8_rows.cpp: exact int32 dot products per group,
then a fixed float order), so a token's result never depends on its batch-mates and int8
speculative decoding reproduces int8 plain decoding bit for bit. There is no fallback:
without the compiled kernel, int8 is refused at load time with the reason (as int4 is).
"""
from __future__ import annotations

import torch
from torch import nn

from forerun.kernels import loader as kernel_loader
from forerun.kernels.backend import choose_backend
from forerun.linears.swap import swap_linears

GROUP = 64  # activation inputs per scale (the kernel's GROUP)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out] per channel
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8),
                             persistent=False)  # [out, in]
        self.register_buffer("weight_scale", scale, persistent=False)  # [out]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.pre_norm = None  # an RMSNorm run first (see absorb_norm)
        self._build_kernels()

    def _build_kernels(self):
        """The kernel's copy of the weights (an opaque layout: rebuilt, not copied or pickled)."""
        kernel = kernel_loader.load()
        if kernel is None:
            raise RuntimeError("int8 needs forerun's compiled kernel, which could not be built here "
                               "(see the warning above); use float32")
        self._kernel = kernel
        self.weight_packed = pack_weight(self.weight_int8)
        self._bind()

    def __getstate__(self):  # deepcopy / pickle: drop the opaque kernel handles...
        state = dict(self.__dict__)
        state.update(_kernel=None, kernel_linear=None, weight_packed=None)
        return state

    def __setstate__(self, state):  # ...and rebuild them from the int8 weights
        super().__setstate__(state)
        self._build_kernels()

    def _bind(self):
        """The kernel call with its arguments bound once in C++ (KernelLinear, layer_rows.cpp):
        forward's one call, and what a whole-layer kernel call takes. nn.Module attribute lookups
        cost ~1 us each. (int8 is a CPU-only path: these tensors never move.)"""
        empty = self.weight_scale[:0]
        bias = self.bias.data if self.bias is not None else empty
        norm_w, eps = (self.pre_norm.weight.data, self.pre_norm.eps) if self.pre_norm is not None else (empty, 0.0)
        self.kernel_linear = self._kernel.KernelLinear(False, self.weight_packed, self.weight_scale, empty, bias, norm_w,
                                                       eps, self.out_features)

    def absorb_norm(self, norm: nn.Module) -> bool:
        """Compute linear(norm(x)) from here on, the norm inside the kernel call (its ~40 us of
        small ops per call is a tenth of an int8 decode step). The caller then drops its own
        call to `norm`. False (nothing changed) for a norm other than a float32 RMSNorm."""
        if type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
            return False
        self.pre_norm = norm
        self._bind()
        return True

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] float32: the weights this linear computes with (a copy)."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.kernel_linear(x if dtype == torch.float32 else x.float())  # one call, no other op
        return y if dtype == torch.float32 else y.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel weights, activations per group of {GROUP}"


def pack_weight(w8: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 -> [Mp/16, Kp/4, 16, 4] uint8 w8 + 128, the layout int8_rows.cpp reads: 64
    bytes hold 4 consecutive inputs of 16 consecutive outputs (Mp: M up to a multiple of 48, the
    kernel's 3-block chunks; Kp: K up to a multiple of 64, its activation groups; padded with
    zero weights)."""
    M, K = w8.shape
    Mp, Kp = -(-M // 48) * 48, -(-K // GROUP) * GROUP
    padded = torch.zeros(Mp, Kp, dtype=torch.int16)
    padded[:M, :K] = w8
    u8 = (padded + 128).to(torch.uint8)
    return u8.view(Mp // 16, 16, Kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def to_int8_(model: nn.Module) -> nn.Module:
    """The int8 model: every linear quantised, then finished on the kernels (finish_on_kernels_)."""
    quantize_int8_(model)
    return finish_on_kernels_(model)


def finish_on_kernels_(model: nn.Module) -> nn.Module:
    """An int8 / int4 / gguf model computed by the kernels: its norms folded into the linears
    they feed where the model can (LlamaForCausalLM.fold_norms), and the kernels' backend with
    the fused ops (kernels/backend.py: per-query chain attention, one-call layers)."""
    if hasattr(model, "fold_norms"):
        model.fold_norms()
    if hasattr(model, "set_backend"):
        model.set_backend(choose_backend(kernel_loader.load(), fused=True))
    return model


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in place (the LM head included: it is the largest GEMM)."""
    from forerun.linears.f32 import F32RowsLinear

    # (a float32 model's kernel linears too)
    return swap_linears(model, lambda c: Int8Linear(c) if isinstance(c, (nn.Linear, F32RowsLinear)) else None)
