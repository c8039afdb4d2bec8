"""float32 linears through forerun's few-token kernel (f32_rows.cpp): each weight streamed
once per forward for all its tokens, and a token's output the same bits for any number of
tokens beside it (one fused multiply-add chain per output, in k order).

Why: a verifier is memory-bound at a few tokens, so scoring k + 1 tokens should cost about
one token's weight stream. torch's sgemm at 2-12 rows does not get there (1.5B model: 8
tokens cost 2.7x one), and it changes its summation order with the row count, so a drafted
token scored among others got other bits than it gets alone. With this linear and the
per-query chain attention, float32 speculative decoding reproduces float32 plain decoding
bit for bit, like int8 (tests/test_f32_kernel.py).
"""
from __future__ import annotations

import torch
from torch import nn

from forerun.kernels.backend import CpuKernels
from forerun.linears.swap import swap_linears


def pack_f32_weight(w: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [Mp/16, K, 16], Mp = M up to a multiple of 48 (f32_rows.cpp's 3-block chunks;
    zero rows): for each k, 16
    consecutive outputs' weights are one 64-byte vector."""
    M, K = w.shape
    Mp = -(-M // 48) * 48
    padded = torch.zeros(Mp, K, dtype=torch.float32)
    padded[:M] = w
    return padded.view(Mp // 16, 16, K).transpose(1, 2).contiguous()


class F32RowsLinear(nn.Module):
    """nn.Linear's function, float32, weights held only in the kernel's packed layout."""

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_packed", pack_f32_weight(linear.weight.detach().float()), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._f32_rows = kernel.f32_rows
        self._set_args()

    def __getstate__(self):  # deepcopy / pickle: the compiled function is found again on load
        return {**self.__dict__, "_f32_rows": None, "_args": None}

    def __setstate__(self, state):
        from forerun.kernels import loader as kernel_loader

        super().__setstate__(state)
        kernel = kernel_loader.load()
        if kernel is None:
            raise RuntimeError("a float32 kernel linear needs forerun's compiled kernel, which is not available here")
        self._f32_rows = kernel.f32_rows
        self._set_args()

    def _set_args(self):
        empty = self.weight_packed.new_empty(0)
        self._args = (self.weight_packed, self.bias.data if self.bias is not None else empty, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], unpacked on demand (a copy: for building other models from this one)."""
        return self.weight_packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The state dict nn.Linear would have (`weight` [out, in], `bias`), not the packing."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None:
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"{prefix}weight: shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}")
            else:
                self.weight_packed = pack_f32_weight(weight.detach().float())
                self._set_args()
        rest = {k: v for k, v in state_dict.items() if k != prefix + "weight"}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self._f32_rows(x, *self._args)

    def _apply(self, fn, recurse=True):  # .to() / .float(): keep the tuple pointing at the moved tensors
        out = super()._apply(fn, recurse)
        self._set_args()
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float32, forerun kernel"


def use_f32_kernels_(model: nn.Module, kernel) -> nn.Module:
    """Every nn.Linear of a float32 CPU model through the kernel; the model's per-query chain
    attention where it has one (LlamaForCausalLM)."""
    swap_linears(model, lambda c: F32RowsLinear(c, kernel) if isinstance(c, nn.Linear) else None)
    if hasattr(model, "set_backend"):
        model.set_backend(CpuKernels(kernel, fused=False))
    return model


def to_plain_linears_(model: nn.Module) -> nn.Module:
    """The inverse of use_f32_kernels_ for the linears: torch's sgemm again (the same function,
    other rounding, not batch-invariant; much faster over hundreds of tokens on a CPU without
    AVX512, e.g. scoring a reference model's long chunks)."""
    return swap_linears(model, lambda c: _plain(c) if isinstance(c, F32RowsLinear) else None)


def _plain(child: F32RowsLinear) -> nn.Linear:
    plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
    plain.weight = nn.Parameter(child.weight.contiguous(), requires_grad=False)
    if child.bias is not None:
        plain.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
    return plain
