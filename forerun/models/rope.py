"""Rotary position embeddings in the rotate-half layout (HF weight layout), with scaling."""
from __future__ import annotations

import math

import torch

from forerun.errors import ModelLoadError


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, after the config's rope scaling; on the CPU
    whatever the default device (built on meta, a model would run torch's Python references
    for them, whose first call imports torch._dynamo: seconds of start-up for nothing)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    try:
        if kind == "linear":
            return inv / scaling["factor"]
        if kind == "llama3":
            return _llama3(inv, scaling)
    except KeyError as e:
        raise ModelLoadError(f"rope_scaling of type {kind!r} lacks the field {e}") from None
    raise ModelLoadError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return torch.where(mid, blended, out)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (broadcast over heads)."""
    angles = positions[..., None].to(inv_freq.dtype) * inv_freq  # [B, T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RopeTable:
    """rope_cos_sin by lookup: the cos / sin of positions [0, P) computed once (the same ops
    on the same angles, so the same bits: tests/test_rope.py), grown when a forward reaches
    past P. A decode step's forward otherwise spends a few ATen calls on them, each slow
    right after the weights streamed through the caches (~80 -> ~40 us a forward)."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, size: int = 4096, source: torch.Tensor | None = None):
        self.inv_freq, self.dtype = inv_freq, dtype  # [head_dim // 2] in the angles' dtype; cos / sin's dtype
        self.source = source  # the buffer inv_freq was taken from (its owner rebuilds the table when it changes)
        self._grow(size)

    def _grow(self, size: int):
        positions = torch.arange(size, device=self.inv_freq.device)[None]  # [1, P]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [1, 1, P, hd]
        self.cos, self.sin = cos[0, 0], sin[0, 0]

    def _cover(self, positions: torch.Tensor):
        """Grow the table to hold every one of these positions (at least doubling it)."""
        if positions.numel() and int(positions.max()) >= len(self.cos):
            self._grow(max(2 * len(self.cos), int(positions.max()) + 1))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (>= 0: slots' positions never are negative) -> cos, sin
        [B, 1, T, head_dim], as rope_cos_sin gives them."""
        if positions.device.type != "cpu":
            self._cover(positions)  # an accelerator asserts on an index past the table, not raises
        try:
            return self.cos[positions][:, None], self.sin[positions][:, None]
        except IndexError:  # past the table (on the CPU the indexing checks: no extra op a step)
            self._cover(positions)
            return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd]: rotate pairs (i, i + hd/2) by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
