"""Batch-size-aware speculation, measured online: one draft length for the whole decode
batch, picked per batch size from the throughput the server itself observed.

Drafting k tokens per row makes a forward over B rows score B * (k + 1) tokens. While that
is memory-bound the extra tokens are nearly free; once the batch fills the machine every
drafted token costs compute and k = 0 wins. Where that happens depends on the model, the
CPU, the drafter and what else runs on the machine, and a cost curve measured up front is
too noisy on a shared CPU to decide it (two runs on this 2-core machine gave cost ratios
from 0.3 to 3.5 for the same shapes). So each batch-size bucket keeps, per candidate k
(0 included), discounted sums of tokens emitted and step seconds, and steps with the best
measured tokens/s; now and then a step tries another candidate in turn, so a choice that
stopped paying is noticed. A try is not free (at 8 rows a k = 4 step scores 40 tokens, and a
draft model first catches up on every token it skipped), so the gap between tries starts at
`explore_every` steps and doubles, up to `explore_every * max_backoff`, each time a try leaves
the best candidate where it was; a try that changes it resets the gap. (With a fixed gap of
12 the Qwen pair's batch-aware server ran 23% below a server without speculation at 8
clients.) Exactness is untouched: k only changes speed.
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
    last: int = 0  # the bucket's step count at this arm's last record

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class BatchK:
    k_max: int
    explore_every: int = 12  # steps between tries of another candidate, at first
    max_backoff: int = 8  # the gap grows to at most explore_every * max_backoff
    decay: float = 0.97  # per step of the bucket: figures from about 30 steps back still count
    min_tries: int = 2  # steps an arm runs before its rate is trusted
    arms: list[int] = field(default_factory=list)  # candidate k values, 0 first
    _stats: dict[tuple[int, int], Arm] = field(default_factory=dict)  # (bucket, k) -> Arm
    _steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps chosen
    _gap: dict[int, int] = field(default_factory=dict)  # bucket -> steps between tries now
    _next_try: dict[int, int] = field(default_factory=dict)  # bucket -> step of the next try
    _tries: dict[int, int] = field(default_factory=dict)  # bucket -> tries so far (whose turn)
    _probe: dict[int, int] = field(default_factory=dict)  # bucket -> best k when a try was chosen

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
        best = self._best(b)
        gap = self._gap.setdefault(b, self.explore_every)
        if n >= self._next_try.setdefault(b, n + gap) and len(self.arms) > 1:
            others = [k for k in self.arms if k != best]
            turn = self._tries[b] = self._tries.get(b, 0) + 1
            self._next_try[b], self._probe[b] = n + gap, best
            return others[turn % len(others)]
        return best

    def record(self, batch: int, k: int, tokens: int | float, seconds: float) -> None:
        b = self.bucket(batch)
        arm = self._stats.setdefault((b, k), Arm())
        now = self._steps.get(b, 0)
        age = self.decay ** max(1, now - arm.last)  # on the bucket's clock: a rarely tried arm's old figures fade
        arm.tokens, arm.seconds, arm.last = age * arm.tokens + tokens, age * arm.seconds + seconds, now
        before = self._probe.get(b)
        if before is not None and k != before:  # the result of a try: back off, or start over
            del self._probe[b]
            kept = self._best(b) == before
            self._gap[b] = min(2 * self._gap[b], self.explore_every * self.max_backoff) if kept else self.explore_every

    def _best(self, b: int) -> int:
        """The candidate with the best measured tokens/s in bucket b (the smaller k on a tie)."""
        return max(self.arms, key=lambda k: (self._stats.get((b, k), Arm()).rate, -k))

    def table(self) -> dict[str, float]:
        """'bucket/k' -> measured tokens/s (for /health and the report)."""
        return {f"{b}/{k}": round(a.rate, 2) for (b, k), a in sorted(self._stats.items()) if a.seconds > 0}
