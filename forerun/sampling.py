"""Logits -> the distribution a token is drawn from, and the draw itself.

One function shapes probabilities for plain sampling, for the verifier's p and for a
drafter's q: speculative sampling is exact only if p here equals plain sampling's.
"""
from __future__ import annotations

import numpy as np
import torch

from forerun.config import SamplingParams


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: logits.argmax(-1), the same indices (the first of equal
    maxima; a NaN counts as the largest). On the CPU numpy's vectorized argmax finds them:
    torch's reads one value at a time (a verify step's 5 x 151,936 logits: ~380 us against
    ~50; a reduced draft head's 32,790: ~30 against ~3)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.numel():
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
    return logits.argmax(-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after temperature, top-k, top-p.

    float64 logits stay float64 (exactness tests); anything else is computed in float32.
    Greedy params (temperature 0) give the one-hot of the argmax.
    """
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(dt)
    x = logits.to(dt)
    # Shift by the max first: a tiny temperature then sends the rest to -inf, not overflow to inf.
    # (A temperature below the dtype's smallest normal, e.g. 1e-300 in float32, would divide 0 by 0.)
    x = (x - x.amax(dim=-1, keepdim=True)) / max(params.temperature, torch.finfo(dt).tiny)
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = _top_p_mask(x, params.top_p)
    return torch.softmax(x, dim=-1)


def _top_p_mask(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (never empty).

    Example: probs sorted [0.5, 0.3, 0.2], top_p 0.7 -> mass *before* each token is
    [0, 0.5, 0.8]; tokens whose preceding mass is already >= top_p go: keep the first two.
    """
    sorted_x, order = x.sort(dim=-1, descending=True)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # the most likely token stays even when top_p rounds to 0 in float32 (5e-324)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities -> [N] token ids, one independent draw per row."""
    return sample_many(probs, 1, generator)[:, 0]


def sample_many(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities (each row's scale free) -> [N, n] ids, n independent draws per row.

    Inverse CDF: one uniform u per draw, the first id whose float64 cumulative mass exceeds
    u x the row's total. An id of zero probability adds nothing to the cumulative sum, so it
    is never the first to exceed anything; u < 1 keeps the draw below the total, and the
    clamp to the last id with mass covers the rounding of u x total up to it. One uniform a
    draw instead of torch.multinomial's one exponential per id (13 ms a draw over Qwen's
    151,936 ids here, against well under 1 ms).
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_many wants [N, V] probabilities, got shape {tuple(probs.shape)}")
    cdf = probs.to(torch.float64).cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not bool(torch.isfinite(total).all() and (total > 0).all() and probs.min() >= 0):
        raise ValueError("probabilities must be finite, non-negative and not all zero in every row")
    u = torch.rand(probs.shape[0], n, generator=generator, dtype=torch.float64, device=probs.device)
    picked = torch.searchsorted(cdf, u * total, right=True)  # [N, n]
    return torch.minimum(picked, torch.searchsorted(cdf, total.contiguous()))  # the last id with mass


def draw(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[list[int], torch.Tensor | None]:
    """A drafter's pick from [B, V] logits: (tokens, q) with q the exact [B, V] distribution
    the tokens were drawn from, or (argmax tokens, None) when greedy."""
    if params.greedy:
        return argmax(logits).tolist(), None
    q = logits_to_probs(logits, params)
    return sample(q, generator).tolist(), q


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
