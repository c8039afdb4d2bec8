"""Rotary position embeddings in the rotate-half layout (HF weight layout), with scaling."""
from __future__ import annotations

import math

import torch

from forerun.errors import ModelLoadError


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, after the config's rope scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd]: rotate pairs (i, i + hd/2) by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
