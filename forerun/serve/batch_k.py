"""Batch-size-aware speculation, measured online: one draft length for the whole decode
batch, picked per batch size from the throughput the server itself observed.

Drafting k tokens per row makes a forward over B rows score B * (k + 1) tokens. While that
is memory-bound the extra tokens are nearly free; once the batch fills the machine every
drafted token costs compute and k = 0 wins. Where that happens depends on the model, the
CPU, the drafter and what else runs on the machine, and a cost curve measured up front is
too noisy on a shared CPU to decide it (two runs on this 2-core machine gave cost ratios
from 0.3 to 3.5 for the same shapes). So each batch-size bucket keeps, per candidate k
(0 included), discounted sums of tokens emitted and step seconds, and steps with the best
measured tokens/s; every `explore_every`-th step of a bucket tries the next candidate in
turn, so a choice that stopped paying is noticed. Exactness is untouched: k only changes
speed.
>>> ctl = BatchK(k_max=4, explore_every=4, min_tries=1)
>>> ctl.arms
[0, 1, 2, 4]
>>> [ctl.choose(8) for _ in range(4)]  # untried candidates first
[0, 1, 2, 4]
>>> for k, tok_per_s in [(0, 100.0), (1, 80.0), (2, 60.0), (4, 50.0)]:
...     ctl.record(8, k, tokens=tok_per_s, seconds=1.0)
>>> ctl.choose(8), ctl.choose(1)
(0, 0)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Arm:
    tokens: float = 0.0  # discounted tokens emitted in steps run with this k
    seconds: float = 0.0  # discounted wall seconds of those steps
    tried: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class BatchK:
    k_max: int
    explore_every: int = 12  # one step in this many tries another candidate
    decay: float = 0.97  # per recorded step: about the last 30 steps of an arm count
    min_tries: int = 2  # steps an arm runs before its rate is trusted
    arms: list[int] = field(default_factory=list)  # candidate k values, 0 first
    _stats: dict[tuple[int, int], Arm] = field(default_factory=dict)  # (bucket, k) -> Arm
    _steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps chosen

    def __post_init__(self):
        if not self.arms:
            self.arms = sorted({0, self.k_max} | {k for k in (1, 2, 4) if k < self.k_max})

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2, 4, 8, ...: the batch size rounded up to a power of two."""
        return 1 << max(0, batch - 1).bit_length()

    def choose(self, batch: int) -> int:
        b = self.bucket(batch)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        arms = [self._stats.setdefault((b, k), Arm()) for k in self.arms]
        for k, arm in zip(self.arms, arms):
            if arm.tried < self.min_tries:
                arm.tried += 1  # counted when chosen: concurrent choices spread over arms
                return k
        if n % self.explore_every == 0:
            return self.arms[(n // self.explore_every) % len(self.arms)]
        return max(zip(self.arms, arms), key=lambda ka: (ka[1].rate, -ka[0]))[0]

    def record(self, batch: int, k: int, tokens: int | float, seconds: float) -> None:
        arm = self._stats.setdefault((self.bucket(batch), k), Arm())
        arm.tokens = self.decay * arm.tokens + tokens
        arm.seconds = self.decay * arm.seconds + seconds

    def table(self) -> dict[str, float]:
        """'bucket/k' -> measured tokens/s (for /health and the report)."""
        return {f"{b}/{k}": round(a.rate, 2) for (b, k), a in sorted(self._stats.items()) if a.seconds > 0}
