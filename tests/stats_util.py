"""Exact reference distributions and a chi-square goodness-of-fit test."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from forerun.config import SamplingParams
from forerun.sampling import logits_to_probs


def next_probs(model, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    """p(. | prefix) by a fresh full forward (no speculative machinery involved)."""
    logits = model.score(prefix, last_only=True)
    return logits_to_probs(logits, params)


def joint_distribution(model, prompt: list[int], params: SamplingParams, n: int = 3) -> dict[tuple, float]:
    """Exact probability of every n-token continuation under plain sampling."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, mass in dist.items():
            p = next_probs(model, prompt + list(prefix), params)
            for tok in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(p[tok])
        dist = nxt
    return dist


def chi2_pvalue(samples: list[tuple], reference: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Goodness of fit of samples to reference; cells with small expectation are pooled."""
    keys = sorted(reference, key=lambda k: -reference[k])
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    unknown = sum(c for s, c in counts.items() if s not in reference)
    if unknown:
        return 0.0  # a continuation plain sampling can never produce
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for k in keys:
        e = reference[k] * n
        if e >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))  # renormalise float rounding
    return float(stats.chisquare(obs, exp).pvalue)


def biased(reference: dict[tuple, float], tv: float) -> dict[tuple, float]:
    """The reference with `tv` mass moved from its most likely cell to its second:
    a sampler that is off by total variation `tv` in the least detectable place."""
    a, b = sorted(reference, key=lambda k: -reference[k])[:2]
    out = dict(reference)
    out[a] -= tv
    out[b] += tv
    return out


def draw(reference: dict[tuple, float], n: int, seed: int) -> list[tuple]:
    keys = list(reference)
    p = np.array([reference[k] for k in keys])
    idx = np.random.default_rng(seed).choice(len(keys), size=n, p=p / p.sum())
    return [keys[i] for i in idx]


__all__ = ["joint_distribution", "chi2_pvalue", "biased", "draw", "itertools"]
