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
draft model first catches up on every token it skipped), so three rules keep tries cheap:
  - the gap between tries starts at `explore_every` steps and doubles, up to
    `explore_every * max_backoff`, each time a try leaves the best candidate where it was; a
    try that changes it resets the gap;
  - a try's one-time overhead (the draft model's catch-up, passed to `record`, kept out of the
    rates) is paid back first: the bucket runs overhead / `try_budget` seconds before the next
    try, so catch-ups take at most that share of its time (a k > 0 try of the Qwen pair at 8
    rows caught up ~600 tokens, about 10 plain steps);
  - drafting more pays less as the batch grows (every drafted token is scored B times), so a
    bucket considers no k above the best of the nearest smaller bucket whose candidates have
    all been measured: once plain decoding wins at 4 rows, 8 rows never draft.
(With a fixed gap of 12 and neither of the last two rules, the Qwen pair's batch-aware server
ran 20-25% below a server without speculation at 8 clients.) Exactness is untouched: k only
changes speed.
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
    steps: int = 0  # steps recorded with this k (for /health)

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
    try_budget: float = 0.05  # the share of a bucket's time that tries' one-time overheads may take
    arms: list[int] = field(default_factory=list)  # candidate k values, 0 first
    _stats: dict[tuple[int, int], Arm] = field(default_factory=dict)  # (bucket, k) -> Arm
    _steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps chosen
    _gap: dict[int, int] = field(default_factory=dict)  # bucket -> steps between tries now
    _next_try: dict[int, int] = field(default_factory=dict)  # bucket -> step of the next try
    _tries: dict[int, int] = field(default_factory=dict)  # bucket -> tries so far (whose turn)
    _probe: dict[int, int] = field(default_factory=dict)  # bucket -> best k when a try was chosen
    _clock: dict[int, float] = field(default_factory=dict)  # bucket -> seconds recorded (overheads included)
    _not_before: dict[int, float] = field(default_factory=dict)  # bucket -> clock before which no try starts

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
        allowed = self._allowed(b)
        for k in allowed:
            arm = self._stats.setdefault((b, k), Arm())
            if arm.tried < self.min_tries:
                arm.tried += 1  # counted when chosen: concurrent choices spread over arms
                return k
        best = self._best(b)
        gap = self._gap.setdefault(b, self.explore_every)
        due = n >= self._next_try.setdefault(b, n + gap) and self._clock.get(b, 0.0) >= self._not_before.get(b, 0.0)
        if due and len(allowed) > 1:
            others = [k for k in allowed if k != best]
            turn = self._tries[b] = self._tries.get(b, 0) + 1
            self._next_try[b], self._probe[b] = n + gap, best
            return others[turn % len(others)]
        return best

    def record(self, batch: int, k: int, tokens: int | float, seconds: float, overhead: float = 0.0) -> None:
        """A step of `batch` rows ran with draft length k: `tokens` emitted in `seconds` of
        steady work, plus `overhead` one-time seconds (a draft model's catch-up)."""
        b = self.bucket(batch)
        arm = self._stats.setdefault((b, k), Arm())
        now = self._steps.get(b, 0)
        age = self.decay ** max(1, now - arm.last)  # on the bucket's clock: a rarely tried arm's old figures fade
        arm.tokens, arm.seconds, arm.last = age * arm.tokens + tokens, age * arm.seconds + seconds, now
        arm.steps += 1
        clock = self._clock[b] = self._clock.get(b, 0.0) + seconds + overhead
        if overhead > 0:  # paid back before the next try
            self._not_before[b] = max(self._not_before.get(b, 0.0), clock) + overhead / self.try_budget
        before = self._probe.get(b)
        if before is not None and k != before:  # the result of a try: back off, or start over
            del self._probe[b]
            kept = self._best(b) == before
            self._gap[b] = min(2 * self._gap[b], self.explore_every * self.max_backoff) if kept else self.explore_every

    def _allowed(self, b: int) -> list[int]:
        """The candidates of bucket b: none above the best k of the nearest smaller bucket
        whose own candidates have all run min_tries steps (all of them if there is none)."""
        for s in sorted((s for s in self._steps if s < b), reverse=True):
            below = self._allowed(s)
            if all(self._stats.get((s, k), Arm()).steps >= self.min_tries for k in below):
                cap = self._best(s)
                return [k for k in self.arms if k <= cap]
        return list(self.arms)

    def _best(self, b: int) -> int:
        """The candidate of bucket b with the best measured tokens/s (the smaller k on a tie)."""
        return max(self._allowed(b), key=lambda k: (self._stats.get((b, k), Arm()).rate, -k))

    def table(self) -> dict[str, float]:
        """'bucket/k' -> measured tokens/s (for /health and the report)."""
        return {f"{b}/{k}": round(a.rate, 2) for (b, k), a in sorted(self._stats.items()) if a.seconds > 0}

    def steps(self) -> dict[str, int]:
        """'bucket/k' -> steps run with it (for /health)."""
        return {f"{b}/{k}": a.steps for (b, k), a in sorted(self._stats.items()) if a.steps}
