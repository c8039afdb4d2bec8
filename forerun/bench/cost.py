"""The verifier's cost curve: forward time against the number of tokens scored at once.

Speculative decoding pays when scoring k + 1 tokens costs about as much as scoring one
(a memory-bound verifier) and stops paying as that ratio grows (compute-bound: larger
models on small machines, large batches). `forerun cost` measures the curve for a model at
each precision, on a cache already holding `context` tokens, and draws it; the ratio
cost(T) / cost(1) is what the advisor and adaptive k read.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from forerun.kv_cache import chain_batch


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


def plot(curves: list[CostCurve], path: str) -> str:
    """cost(T) / cost(1) per curve, with the ideal (flat) and the compute-bound (T) lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max(max(c.ms) for c in curves)
    for c in curves:
        xs = sorted(c.ms)
        ax.plot(xs, [c.ratio(x) for x in xs], marker="o", label=f"{c.model} {c.dtype} ({c.ms[1]:.0f} ms at 1)")
    ax.plot([1, top], [1, 1], ls=":", c="grey", label="memory-bound ideal")
    ax.plot([1, top], [1, top], ls="--", c="lightgrey", label="compute-bound (cost ∝ T)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.8, max(2.5, max(c.ratio(max(c.ms)) for c in curves) * 1.1))
    ax.set_xlabel("tokens scored in one forward (k + 1)")
    ax.set_ylabel("forward time / one-token forward time")
    ax.set_title(f"verifier cost curve ({torch.get_num_threads()} threads, context {curves[0].context})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
