"""The int8 GEMMs behind Int8Linear (quant.py), each giving the same per-token bits: fbgemm's
dynamic linear (the reference numerics) and oneDNN's int8 GEMM (fast for many tokens where it
matches, see int8_probe.py). Rows are scaled per token to [-1, 1] first, so a token's result
does not depend on the tokens beside it (quant.py's docstring has the recipe)."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch


def fbgemm_prepack(w8: torch.Tensor, w_scale: torch.Tensor):
    """fbgemm's packed form of int8 weights [out, in] with per-channel scales [out]."""
    zeros = torch.zeros(w8.shape[0], dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(w8, w_scale.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(qw, None)


def fbgemm_anchor(n_in: int) -> torch.Tensor:
    """[1, in] = [1, 0, ..., 0, -1]: appended to fbgemm's input, it pins the tensor's
    quantisation range to [-1, 1], the range every per-token-scaled row spans."""
    anchor = torch.zeros(1, n_in)
    anchor[0, 0], anchor[0, -1] = 1.0, -1.0
    return anchor


def fbgemm_rows(x: torch.Tensor, packed, anchor: torch.Tensor) -> torch.Tensor:
    """[N, in] -> [N, out] (no bias): the reference numerics, any N (the anchor row pins the
    tensor's quantisation range to [-1, 1], so every row is quantised on its own)."""
    n = x.shape[0]
    s = _row_scale(x)
    staged = _staging(anchor, n)  # [N + 1, in], last row the anchor
    torch.div(x, s, out=staged[:n])
    return torch.ops.quantized.linear_dynamic(staged, packed, True)[:n].mul_(s)


def onednn_rows(x: torch.Tensor, prepacked, w_scale: torch.Tensor, w_zero: torch.Tensor) -> torch.Tensor:
    """[N, in] -> [N, out] (no bias) through oneDNN's int8 GEMM, per-token scaled like the others."""
    s = _row_scale(x)
    scale, zero = activation_qparams()
    with quiet():
        q = torch.quantize_per_tensor(x / s, scale, zero, torch.quint8).int_repr()
    y = torch.ops.onednn.qlinear_pointwise(
        q, scale, zero, prepacked, w_scale, w_zero, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return y.mul_(s)


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    """[N, in] -> [N, 1] each token's max |x| (vector_norm(inf) is 10x slower at 800 rows)."""
    return x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        yield


@functools.cache
def activation_qparams() -> tuple[float, int]:
    """The uint8 scale and zero point fbgemm's dynamic linear (reduce_range) picks for an
    input spanning exactly [-1, 1], as every per-token-scaled input does."""
    with quiet():  # (torch's deprecation warning for quantized tensors: one line per process otherwise)
        q = torch.quantize_per_tensor_dynamic(torch.tensor([[1.0, -1.0]]), torch.quint8, True)
    return q.q_scale(), q.q_zero_point()


_STAGED: dict[tuple[int, int], torch.Tensor] = {}  # (in_features, N) -> [N + 1, in] buffer


def _staging(anchor: torch.Tensor, n: int) -> torch.Tensor:
    """A reusable fbgemm input buffer whose last row holds the anchor (one op saved per call).
    Layers run one after another, so one buffer per (width, N) is enough; wide inputs get a
    fresh one rather than pinning memory."""
    key = (anchor.shape[1], n)
    buf = _STAGED.get(key)
    if buf is None or buf.device != anchor.device:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = torch.empty(n + 1, anchor.shape[1], device=anchor.device)
            buf[n] = anchor[0]
        if n <= 64:
            _STAGED[key] = buf
    return buf
