"""Batch-size-aware speculation: one draft length for the whole decode batch, from the
verifier's measured cost of scoring n tokens in one forward.

A batch of B rows drafting k tokens each scores B * (k + 1) tokens per forward. While that
stays memory-bound (cost about flat) speculation is nearly free; once the batch alone fills
the machine, every drafted token costs real compute and k = 0 wins. Per step:
    rate(k) = B * tokens(alpha, k) / (cost(B * (k + 1)) + k * draft)     (adaptive.py's model)
and the batch drafts argmax_k rate(k), k = 0 included, so by the model speculation is never
chosen where plain decoding is predicted faster. `alpha` is the server's running acceptance.
>>> curve = CostModel({1: 1.0, 8: 1.0, 16: 2.0, 64: 8.0})
>>> curve(4), curve(12), curve(128)
(1.0, 1.5, 16.0)
>>> batch_k(alpha=0.7, batch=1, k_max=5, cost=curve, draft=0.0), batch_k(0.7, 8, 5, curve, 0.0)
(5, 0)
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from forerun.adaptive import expected_tokens


@dataclass
class CostModel:
    """Forward cost against tokens scored, relative to one token; linear in between the
    measured points and proportional past the last one (compute-bound)."""

    points: dict[int, float]  # tokens scored -> cost / cost(1 token)

    def __call__(self, tokens: int) -> float:
        xs = sorted(self.points)
        if tokens <= xs[0]:
            return self.points[xs[0]]
        if tokens >= xs[-1]:
            return self.points[xs[-1]] * tokens / xs[-1]
        i = bisect_left(xs, tokens)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.points[x0], self.points[x1]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    @classmethod
    def measure(cls, model, max_tokens: int) -> "CostModel":
        """A few timed forwards (bench.cost.measure) at 1, 2, 4, ... up to max_tokens."""
        from forerun.bench.cost import measure

        sizes = sorted({1, max_tokens} | {2**i for i in range(1, 12) if 2**i < max_tokens})
        ms = measure(model, sizes, context=64, repeats=2)
        return cls({t: ms[t] / ms[1] for t in sizes})


def batch_k(alpha: float, batch: int, k_max: int, cost: CostModel, draft: float) -> int:
    """The draft length in [0, k_max] with the best predicted tokens per unit of time for a
    batch of `batch` rows; draft = drafter time per drafted token / one-token forward."""
    if batch < 1 or k_max < 1:
        return 0
    rates = [batch * expected_tokens(alpha, k) / (cost(batch * (k + 1)) + k * draft) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))
