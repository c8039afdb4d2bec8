"""The verifier's cost curve: forward time against the number of tokens scored at once.

Speculative decoding pays when scoring k + 1 tokens costs about as much as scoring one
(a memory-bound verifier) and stops paying as that ratio grows (compute-bound: larger
models on small machines, large batches). `forerun cost` measures the curve for a model at
each precision, on a cache already holding `context` tokens, and draws it; the ratio
cost(T) / cost(1) is what the advisor and adaptive k read (LLM measures it for `--k auto`;
bench/cost.py draws it).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from forerun.kv.cache import chain_batch


@dataclass
class CostCurve:
    model: str
    dtype: str
    context: int
    ms: dict[int, float] = field(default_factory=dict)  # tokens scored -> median ms per forward

    def ratio(self, tokens: int) -> float:
        return self.ms[tokens] / self.ms[1]


@torch.inference_mode()
def measure(model, tokens: list[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median ms of one forward scoring T tokens after `context` cached ones, for each T.
    The T values run interleaved, `repeats` rounds, so machine noise hits them alike."""
    cache = model.new_cache(1, context + max(tokens) + 1)
    vocab = model.config.vocab_size
    prompt = [(i * 7919 + 10) % vocab for i in range(context)]
    model(chain_batch([prompt], [0], [0], model.device), cache, logits_at=None)
    times: dict[int, list[float]] = {t: [] for t in tokens}
    for round_ in range(repeats + 1):
        for t in tokens:
            batch = chain_batch([[(11 + i) % vocab for i in range(t)]], [context], [0], model.device)
            start = time.perf_counter()
            model(batch, cache)
            if round_:  # the first round warms up
                times[t].append((time.perf_counter() - start) * 1e3)
    return {t: statistics.median(v) for t, v in times.items()}
