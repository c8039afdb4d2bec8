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
draft model first catches up on every token it skipped), so these rules keep them cheap:
  - the gap between tries starts at `explore_every` steps and doubles, up to
    `explore_every * max_backoff`, each time a try leaves the best candidate where it was; a
    try that changes it resets the gap;
  - a try's one-time overhead (the draft model's catch-up on tokens its rows skipped, passed
    to `record`, kept out of the rates) comes out of a budget: a try starts only while the
    bucket's catch-ups so far plus the one it needs (`switch_cost`, passed to `choose`) stay
    within `try_budget` (5%) of the bucket's time; a candidate's first tries also start where
    their catch-up takes at most one of the bucket's mean steps. A new
    request's prompt, fed to the draft model at its first drafting step, is no such overhead: every request pays it while drafting is on, so its seconds are spread over
    the tokens drafting steps emit, and each k > 0 rate carries that cost per token;
  - a larger k is chosen over a smaller one only where its rate is `margin` (5%) higher: a
    draft model pays for every new request's prompt and every switch back to drafting;
  - drafting more pays less as the batch grows (every drafted token is scored B times), so a
    bucket considers no k above the best of the nearest smaller bucket whose candidates have
    all been measured: once plain decoding wins at 4 rows, 8 rows never draft.
(With a fixed gap of 12 and none of the last three rules, the Qwen pair's batch-aware server
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
    margin: float = 0.05  # a larger k is chosen only where its tokens/s beat the smaller k's by this share
    arms: list[int] = field(default_factory=list)  # candidate k values, 0 first
    _stats: dict[tuple[int, int], Arm] = field(default_factory=dict)  # (bucket, k) -> Arm
    _steps: dict[int, int] = field(default_factory=dict)  # bucket -> steps chosen
    _gap: dict[int, int] = field(default_factory=dict)  # bucket -> steps between tries now
    _next_try: dict[int, int] = field(default_factory=dict)  # bucket -> step of the next try
    _tries: dict[int, int] = field(default_factory=dict)  # bucket -> tries so far (whose turn)
    _probe: dict[int, int] = field(default_factory=dict)  # bucket -> best k when a try was chosen
    _clock: dict[int, float] = field(default_factory=dict)  # bucket -> seconds recorded (overheads included)
    _spent: dict[int, float] = field(default_factory=dict)  # bucket -> overhead seconds (catch-ups) so far
    _prompt_seconds: float = 0.0  # discounted seconds a draft model spent on new requests' prompts
    _drafted_tokens: float = 0.0  # discounted tokens emitted by steps with k > 0 (what those prompts bought)

    def __post_init__(self):
        if not self.arms:
            self.arms = sorted({0, self.k_max} | {k for k in (1, 2, 4) if k < self.k_max})

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2, 4, 8, ...: the batch size rounded up to a power of two."""
        return 1 << max(0, batch - 1).bit_length()

    def choose(self, batch: int, switch_cost: float = 0.0, remaining: int | None = None) -> int:
        """The draft length for a step of `batch` rows. `switch_cost`: seconds a k > 0 step would
        first spend feeding the draft model what its rows have not seen; `remaining`: tokens the
        rows may still emit. A k > 0 whose measured gain over k = 0 cannot pay that back within
        `remaining` tokens gives way to k = 0 (so a batch near its end never switches drafting on)."""
        b = self.bucket(batch)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        allowed = self._allowed(b)
        for k in allowed:
            arm = self._stats.setdefault((b, k), Arm())
            if arm.tried < self.min_tries:
                if k and not (self._affordable(b, switch_cost, first=True) and self._pays_back(b, k, switch_cost, remaining)):
                    return 0
                arm.tried += 1  # counted when chosen: concurrent choices spread over arms
                return k
        best = self._best(b, allowed)
        gap = self._gap.setdefault(b, self.explore_every)
        if n >= self._next_try.setdefault(b, n + gap) and len(allowed) > 1:
            others = [k for k in allowed if k != best]
            turn = self._tries.get(b, 0) + 1
            k = others[turn % len(others)]
            if not k or (self._affordable(b, switch_cost) and self._pays_back(b, k, switch_cost, remaining)):
                self._tries[b], self._next_try[b], self._probe[b] = turn, n + gap, best
                return k
        return best if not best or self._pays_back(b, best, switch_cost, remaining) else 0

    def _affordable(self, b: int, switch_cost: float, first: bool = False) -> bool:
        """Whether bucket b's catch-ups so far plus this one stay within try_budget of its time;
        a candidate's first tries also whenever this catch-up takes no longer than the bucket's
        mean step (else, while k = 0 runs, the tokens to catch up on can grow as fast as the
        budget does, and drafting is never tried at all)."""
        clock = self._clock.get(b, 0.0)
        recorded = sum(arm.steps for (s, _), arm in self._stats.items() if s == b)  # the steps clock counts
        if first and 0 < switch_cost <= clock / max(1, recorded):
            return True
        return self._spent.get(b, 0.0) + switch_cost <= self.try_budget * clock

    def _pays_back(self, b: int, k: int, switch_cost: float, remaining: int | None) -> bool:
        """Whether `remaining` tokens at k's measured rate instead of k = 0's save more than
        `switch_cost` seconds (yes when there is nothing to pay or nothing measured yet)."""
        if switch_cost <= 0 or remaining is None or self._stats.get((b, 0), Arm()).seconds <= 0:
            return True
        saved = remaining / self.rate(b, 0) - remaining / self.rate(b, k)  # 1 / inf = 0: an untried k
        return saved > switch_cost

    def record(self, batch: int, k: int, tokens: int | float, seconds: float, overhead: float = 0.0,
               prompt: float = 0.0) -> None:
        """A step of `batch` rows ran with draft length k: `tokens` emitted in `seconds` of
        steady work, plus `overhead` one-time seconds (a draft model's catch-up on skipped
        tokens) and `prompt` seconds (its first feed of new requests' prompts)."""
        b = self.bucket(batch)
        if k > 0:
            self._prompt_seconds = self.decay * self._prompt_seconds + prompt
            self._drafted_tokens = self.decay * self._drafted_tokens + tokens
        arm = self._stats.setdefault((b, k), Arm())
        now = self._steps.get(b, 0)
        age = self.decay ** max(1, now - arm.last)  # on the bucket's clock: a rarely tried arm's old figures fade
        arm.tokens, arm.seconds, arm.last = age * arm.tokens + tokens, age * arm.seconds + seconds, now
        arm.steps += 1
        self._clock[b] = self._clock.get(b, 0.0) + seconds + overhead + prompt
        self._spent[b] = self._spent.get(b, 0.0) + overhead
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
                cap = self._best(s, below)
                return [k for k in self.arms if k <= cap]
        return list(self.arms)

    def _best(self, b: int, allowed: list[int] | None = None) -> int:
        """The candidate of bucket b (of `allowed`, its candidates, when already at hand) with the
        best measured tokens/s, where a larger k must beat a smaller one by `margin` (switching
        drafting on costs more than the rates show)."""
        best, *rest = allowed if allowed is not None else self._allowed(b)
        for k in rest:
            if self.rate(b, k) > self.rate(b, best) * (1 + self.margin):
                best = k
        return best

    def rate(self, b: int, k: int) -> float:
        """Bucket b's measured tokens/s with draft length k; for k > 0 each token also carries
        its share of the draft model's prompt feeds (prompt seconds per token drafting emitted)."""
        arm = self._stats.get((b, k), Arm())
        if k == 0 or arm.seconds <= 0 or self._drafted_tokens <= 0:
            return arm.rate
        return arm.tokens / (arm.seconds + arm.tokens * self._prompt_seconds / self._drafted_tokens)

    def table(self) -> dict[str, float]:
        """'bucket/k' -> measured tokens/s (for /health and the report)."""
        return {f"{b}/{k}": round(self.rate(b, k), 2) for (b, k), a in sorted(self._stats.items()) if a.seconds > 0}

    def steps(self) -> dict[str, int]:
        """'bucket/k' -> steps run with it (for /health)."""
        return {f"{b}/{k}": a.steps for (b, k), a in sorted(self._stats.items()) if a.steps}
