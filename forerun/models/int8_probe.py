"""Which int8 GEMM serves wide inputs (WIDE_ROWS tokens or more) on this CPU: decided once
per process by comparing bits, never assumed from the CPU's name.

Every int8 path must give fbgemm's per-token bits (int8_gemm.py), or a token's logits would
depend on how many tokens share its forward (a 63-token verify vs a 64-token one, a prompt
alone vs batched with others). oneDNN picks its int8 kernel by CPU: with AMX its float
epilogue rounds like fbgemm's; on an AVX512-VNNI Xeon without AMX about 29% of outputs
differ in the last bit. So oneDNN is used only where a probe finds it exact here; otherwise
the few-token path (forerun's kernel, or fbgemm) serves every size, at about the same
speed on such CPUs (measured in docs/results.md).

FORERUN_INT8_WIDE=onednn|kernel|fbgemm forces a choice (to measure it, or to show that the
bit-level tests fail with the wrong one).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from forerun.models import int8_kernel
from forerun.models.int8_gemm import fbgemm_anchor, fbgemm_prepack, fbgemm_rows, onednn_available, onednn_rows, quiet

log = logging.getLogger(__name__)
CHOICES = ("onednn", "kernel", "fbgemm")
# (in, out, rows): a toy shape, SmolLM2's q/k/v and one past a few oneDNN blocking sizes.
PROBE_SHAPES = ((96, 80, 128), (576, 960, 64), (200, 333, 257))


@functools.cache
def wide_path() -> str:
    """"onednn" where oneDNN's int8 GEMM reproduces fbgemm's bits on this CPU, else
    "kernel" (forerun's compiled kernel) or "fbgemm" where the kernel is not built."""
    fallback = "kernel" if int8_kernel.load() is not None else "fbgemm"
    forced = os.environ.get("FORERUN_INT8_WIDE", "").strip().lower()
    if forced:
        if forced not in CHOICES or (forced == "onednn" and not onednn_available()) or (forced == "kernel" and fallback != "kernel"):
            raise ValueError(f"FORERUN_INT8_WIDE={forced!r}: not available here (choices: {', '.join(CHOICES)})")
        return forced
    if not onednn_available():
        return fallback
    exact = all(onednn_matches_fbgemm(*shape) for shape in PROBE_SHAPES)
    choice = "onednn" if exact else fallback
    log.info("forerun: int8 wide GEMM = %s (oneDNN %s fbgemm's bits on this CPU)", choice, "matches" if exact else "does not match")
    return choice


def onednn_matches_fbgemm(n_in: int, n_out: int, rows: int, gemm=None) -> bool:
    """One random layer and `rows` tokens of very different ranges (and exact quantisation
    ties): does `gemm` (default oneDNN's) give fbgemm's bits for every output?"""
    g = torch.Generator().manual_seed(n_in * 7919 + n_out)
    w = torch.randn(n_out, n_in, generator=g)
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    with quiet():
        w8 = torch.quantize_per_channel(w, scale.double(), torch.zeros(n_out, dtype=torch.long), 0, torch.qint8).int_repr()
    x = torch.randn(rows, n_in, generator=g) * torch.rand(rows, 1, generator=g) * 8
    x[0] = torch.linspace(-1, 1, n_in)  # many values on a rounding tie
    with torch.inference_mode():
        ref = fbgemm_rows(x, fbgemm_prepack(w8, scale), fbgemm_anchor(n_in))
        if gemm is None:
            prepacked = torch.ops.onednn.qlinear_prepack(w8, None)
            got = onednn_rows(x, prepacked, scale, torch.zeros(n_out, dtype=torch.int32))
        else:
            got = gemm(x, w8, scale)
    return torch.equal(got, ref)
