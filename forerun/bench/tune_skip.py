"""Training-free search for a layer-skip drafter (`forerun tune-skip`).

1. Calibration: the verifier's own greedy continuations of a few prompts (the text the
   drafter will have to predict), teacher-forced in one forward per candidate.
2. Per-layer cost: (full forward - zero-layer forward) / L at one new token, measured.
3. Rank layers by how little skipping each one alone changes the argmax, then grow the
   skip set along that ranking. For each size, top-1 agreement a with the full model
   estimates the mean accepted length of a k-token chain, tau = (1 - a^(k+1)) / (1 - a),
   and tokens/s = tau / (k * draft cost + verify cost).
4. Confirm the best estimates with timed generation, plain run alongside; save the winner.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.kv.cache import chain_batch


@dataclass
class Candidate:
    skip: list[int]
    agreement: float  # top-1 agreement with the full model on the calibration text
    est_tokens_per_s: float
    measured_speedup: float | None = None


def _forward_argmax(model, seqs: list[list[int]], skip: frozenset[int]) -> list[torch.Tensor]:
    return [model.score(ids, skip).argmax(-1) for ids in seqs]


def _agreement(model, seqs, full: list[torch.Tensor], skip: frozenset[int], starts: list[int]) -> float:
    preds = _forward_argmax(model, seqs, skip)
    hits = sum(int((p[s:] == f[s:]).sum()) for p, f, s in zip(preds, full, starts))
    return hits / sum(len(f) - s for f, s in zip(full, starts))


def _cost(model, skip: frozenset[int], context: int = 128, reps: int = 5) -> float:
    """Seconds per one-token forward with `skip` at a given context length (best of reps)."""
    cache = model.new_cache(1, context + 2)
    with torch.inference_mode():
        model(chain_batch([[1] * context], [0], [0], model.device), cache, logits_at=None, skip=skip)
        batch = chain_batch([[1]], [context], [0], model.device)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            model(batch, cache, skip=skip)
            best = min(best, time.perf_counter() - t)
    return best


def estimate(agreement: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Expected tokens/s of a k-token chain whose tokens are each accepted w.p. agreement."""
    a = min(agreement, 0.999)
    tau = (1 - a ** (k + 1)) / (1 - a)
    return tau / (k * draft_cost + verify_cost)


def search(llm, calib_ids: list[list[int]], k: int, max_skip: int, progress=None) -> list[Candidate]:
    """calib_ids: prompt + greedy continuation token ids; agreement counts the continuation."""
    model = llm.model
    n = model.config.num_hidden_layers
    starts = [len(s) // 2 for s in calib_ids]
    full = _forward_argmax(model, calib_ids, frozenset())
    per_layer = (_cost(model, frozenset()) - _cost(model, frozenset(range(n)))) / n
    base = _cost(model, frozenset(range(n)))  # embedding + final norm + LM head
    verify = _cost(model, frozenset())
    single = {}
    for i in range(n):
        single[i] = _agreement(model, calib_ids, full, frozenset([i]), starts)
        if progress:
            progress(1)
    order = sorted(single, key=lambda i: -single[i])
    out = []
    for size in range(1, max_skip + 1):
        skip = frozenset(order[:size])
        a = _agreement(model, calib_ids, full, skip, starts)
        draft = base + per_layer * (n - size)
        out.append(Candidate(sorted(skip), a, estimate(a, k, draft, verify)))
        if progress:
            progress(1)
    return sorted(out, key=lambda c: -c.est_tokens_per_s)


def confirm(llm, prompts: list[list[int]], cands: list[Candidate], k: int, max_tokens: int) -> list[Candidate]:
    """Timed generation for each candidate beside plain decoding (alternating)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for c in cands:
        spec = SpeculativeConfig("layer_skip", k, skip_layers=tuple(c.skip))
        t_plain = t_spec = 0.0
        for i, ids in enumerate(prompts):
            order = [spec, None] if i % 2 else [None, spec]
            for s in order:
                t = time.perf_counter()
                llm.generate([ids], params, speculative=s)
                dt = time.perf_counter() - t
                t_plain, t_spec = (t_plain + dt, t_spec) if s is None else (t_plain, t_spec + dt)
        c.measured_speedup = t_plain / t_spec
    return sorted(cands, key=lambda c: -(c.measured_speedup or 0))
