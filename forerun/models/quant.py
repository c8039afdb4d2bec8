"""int8 linears for the CPU: per-channel weight scales, per-token activation scales.

torch's dynamic int8 linear (fbgemm) picks ONE activation range for the whole input
tensor, so a token's result depends on the tokens scored beside it: speculative and
plain decoding would then see different numerics by construction. We make the range
per token without a new kernel:
  1. divide each token's row by its own max |x| (every row now spans at most [-1, 1]);
  2. append one anchor row [1, -1, 0, ...], so the tensor's range is exactly [-1, 1]
     whatever the batch holds -> the kernel's quantisation parameters are constant;
  3. run the int8 GEMM (int32 accumulation: exact) and multiply each row back by its scale.
A token's output is then independent of its batch-mates *given the same input row*.
Whole-model identity between scoring one token and several still does not follow: the
float ops before each linear (attention, norms) differ in the last bits between the two
shapes, and a last-bit change that flips one rounding moves the value by a whole
quantisation step. `forerun compare` therefore reports int8's match share, not identity.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # [out] per channel
        zero = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():  # deprecated upstream, still the fast fbgemm path in 2.13
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qw = torch.quantize_per_channel(w, scale, zero, axis=0, dtype=torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 1.0, -1.0
        self.register_buffer("anchor", anchor, persistent=False)  # pins the tensor range to [-1, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # [N, in]
        s = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [N, 1] per-token scale
        xin = torch.cat([x2 / s, self.anchor], dim=0)  # [N + 1, in], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(xin, self._packed, True)[:-1] * s  # [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel weights, per-token activations"


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in place (the LM head included: it is the largest GEMM)."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model
