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
Wide inputs (prefill) go to oneDNN's int8 GEMM instead (AMX/VNNI: 2-4x faster than fbgemm
at 800 tokens on this CPU, slower at 1): it is fed the very uint8 values fbgemm would have
made, and int32 accumulation is exact, so both kernels return the same bits (tested).
Whole-model identity between scoring one token and several still does not follow: the
float ops before each linear (attention, norms) differ in the last bits between the two
shapes, and a last-bit change that flips one rounding moves the value by a whole
quantisation step. `forerun compare` therefore reports int8's match share, not identity.
"""
from __future__ import annotations

import functools
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
        self._wide = None  # oneDNN's copy of the same int8 weights, for prefill-sized inputs
        if _onednn_available():
            zeros = torch.zeros(qw.shape[0], dtype=torch.int32)
            self._wide = (torch.ops.onednn.qlinear_prepack(qw.int_repr().contiguous(), None), scale.float(), zeros)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 1.0, -1.0
        self.register_buffer("anchor", anchor, persistent=False)  # pins the tensor range to [-1, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Few ops on purpose: at one token per forward this wrapper's op count, not the GEMM,
        # is most of a layer's time.
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        n = x2.shape[0]
        s = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # [N, 1] per token (vector_norm(inf): 10x slower)
        if n >= WIDE_ROWS and self._wide is not None:
            y = self._wide_gemm(x2 / s).mul_(s)
        else:
            staged = _staging(self.anchor, n)  # [N + 1, in], last row the anchor: range exactly [-1, 1]
            torch.div(x2, s, out=staged[:n])
            y = torch.ops.quantized.linear_dynamic(staged, self._packed, True)[:n].mul_(s)  # [N, out]
        if self.bias is not None:
            y = y.add_(self.bias)
        y = y.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _wide_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] within [-1, 1] -> [N, out], quantised exactly as fbgemm's dynamic path does."""
        scale, zero = _activation_qparams()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            q = torch.quantize_per_tensor(x, scale, zero, torch.quint8).int_repr()
        packed, w_scale, w_zero = self._wide
        return torch.ops.onednn.qlinear_pointwise(
            q, scale, zero, packed, w_scale, w_zero, None, 1.0, 0, torch.float32, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel weights, per-token activations"


WIDE_ROWS = 64  # from this many tokens on, oneDNN's GEMM beats fbgemm's (measured: 800 tokens 2-4x)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def _activation_qparams() -> tuple[float, int]:
    """The uint8 scale and zero point fbgemm's dynamic linear (reduce_range) picks for an
    input spanning exactly [-1, 1], as every anchored input does."""
    q = torch.quantize_per_tensor_dynamic(torch.tensor([[1.0, -1.0]]), torch.quint8, True)
    return q.q_scale(), q.q_zero_point()


_STAGED: dict[tuple[int, int], torch.Tensor] = {}  # (in_features, N) -> [N + 1, in] buffer


def _staging(anchor: torch.Tensor, n: int) -> torch.Tensor:
    """A reusable input buffer whose last row holds the anchor (one op saved per linear).
    Layers run one after another, so one buffer per (width, N) is enough; wide prefill
    inputs get a fresh one rather than pinning memory."""
    key = (anchor.shape[1], n)
    buf = _STAGED.get(key)
    if buf is None or buf.device != anchor.device:
        buf = torch.empty(n + 1, anchor.shape[1], device=anchor.device)
        buf[n] = anchor[0]
        if n <= 64:
            _STAGED[key] = buf
    return buf


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in place (the LM head included: it is the largest GEMM)."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model
