"""Adaptive speculation (`num_speculative_tokens="auto"`): each step, each row drafts the k
that maximises expected tokens per second, from an online estimate of its acceptance rate
and the step times measured as it runs. k = 0 (plain decoding) is a choice like any other, so
a drafter that does not pay on some text is switched off there, and probed again now and then.

The model, per step of a row that drafts k tokens:
    tokens(k)  = (1 - a^(k+1)) / (1 - a)     expected tokens emitted (Leviathan et al.),
                                              a = per-token acceptance probability
    seconds(k) = the wall time of the steps that drafted k (drafter and verifier), measured
                 and discounted; for a k not run yet, the nearest measured k's seconds scaled
                 by the prior shape verify(k + 1) + k * draft
with verify(T) the forward cost of scoring T tokens measured up front (`bench.cost.measure`,
at a short context) and draft the drafter's measured seconds per drafted token. The prior
alone misleads: a drafter's time is not proportional to k (a draft model's first forward
also feeds the tokens the last step accepted: the 0.5B Qwen drafter took 21 / 30 / 44 ms a
step at k 1 / 2 / 3 over a 1,500-token context) and the curve's context is not the request's.
So every `probe_every` steps at a k > 0 a row drafts one more or one less (alternately),
which keeps the measured times around its best k fresh and lets it move there; and a row
that turned drafting off probes k = 1 after 2, 4, ... up to `probe_every` steps, so a dip of
its noisy acceptance estimate does not hold it at k = 0 for long.
Verification is untouched, so every choice of k keeps the output exact: only speed depends on
this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step emits on average when each draft token is accepted with prob. alpha.
    >>> expected_tokens(0.0, 5), expected_tokens(1.0, 5), round(expected_tokens(0.5, 2), 3)
    (1.0, 6.0, 1.75)
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, step_cost: list[float], draft_cost: float = 0.0, k_max: int | None = None) -> int:
    """argmax over k in [0, k_max] of tokens(k) / time(k), time(k) = step_cost[k] + k * draft_cost
    (step_cost[k]: a step drafting k, in any one unit; draft_cost: extra per drafted token).
    >>> best_k(0.9, [1.0] * 9, 0.05, 8), best_k(0.2, [1.0, 1.3, 1.6], 0.5, 2)
    (8, 0)
    """
    k_max = len(step_cost) - 1 if k_max is None else k_max
    rates = [expected_tokens(alpha, k) / (step_cost[k] + k * draft_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


@dataclass
class RowEstimate:
    """Discounted counts of accepted draft tokens and of rejections (a step that stopped
    before the end of its draft), with a weak prior of acceptance 0.5."""

    accepted: float = 1.0
    rejected: float = 1.0
    idle: int = 0  # consecutive steps at k = 0
    gap: int = 2  # k = 0 steps before the next 1-token probe: 2, 4, ... up to probe_every
    busy: int = 0  # steps at k > 0 since the last neighbour probe
    side: int = 1  # the next neighbour probe: +1 (one more) or -1 (one less)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class StepTime:
    """Discounted seconds and count of the steps that drafted one k."""

    seconds: float = 0.0
    weight: float = 0.0

    @property
    def mean(self) -> float:
        return self.seconds / self.weight


@dataclass
class AdaptiveK:
    k_max: int
    verify_cost: list[float]  # [k_max + 1]: cost of scoring t + 1 tokens / one token (the prior's shape)
    decay: float = 0.9  # per step: about the last 10 steps count
    probe_every: int = 8  # after this many steps at k = 0, draft 1 token; at k > 0, k + 1 or k - 1
    forward_s: float = 0.0  # measured seconds of a one-token verifier forward
    draft_cost: float = 0.0  # drafter seconds per drafted token / forward_s (the prior's draft term)
    time_decay: float = 0.8  # per step of the same k: its last few steps count
    rows: dict[int, RowEstimate] = field(default_factory=dict)
    times: dict[int, StepTime] = field(default_factory=dict)  # k -> measured step seconds
    _draft_samples: int = 0
    _last_k: int | None = None

    def k_for(self, row: int) -> int:
        est = self.rows.setdefault(row, RowEstimate())
        k = best_k(est.alpha, self.step_seconds())
        if k == 0:
            est.idle += 1
            if est.idle >= est.gap:  # a probe; the next one waits twice as long, up to probe_every
                est.idle, est.gap = 0, min(2 * est.gap, self.probe_every)
                return 1
            return 0
        est.gap = 2
        est.busy += 1
        if est.busy >= self.probe_every:
            est.busy, est.side = 0, -est.side
            return min(self.k_max, max(0, k + est.side))
        return k

    def step_seconds(self) -> list[float]:
        """Each k's step time: measured, or the nearest measured k's scaled by the prior
        (all in the prior's units while nothing is measured)."""
        prior = [self.verify_cost[k] + k * self.draft_cost for k in range(self.k_max + 1)]
        measured = [k for k, t in self.times.items() if t.weight > 0]
        if not measured:
            return prior
        out = []
        for k in range(self.k_max + 1):
            near = min(measured, key=lambda j: (abs(j - k), -j))
            out.append(self.times[near].mean * prior[k] / prior[near])
        return out

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """After a step: `accepted` of `drafted` tokens kept (drafted 0: nothing learned)."""
        if drafted <= 0:
            return
        est = self.rows.setdefault(row, RowEstimate())
        est.accepted = self.decay * est.accepted + accepted
        est.rejected = self.decay * est.rejected + (1.0 if accepted < drafted else 0.0)
        if accepted:
            est.idle = 0

    def observe_step(self, k: int, draft_s: float, verify_s: float) -> None:
        """A step ran whose longest draft was k tokens, its drafter taking draft_s seconds and
        its verifier forward verify_s. Not counted as k's time: the first drafting step of a
        generate (a drafter with its own cache feeds it the whole prompt then) and a drafting
        step right after a k = 0 step (it first catches up on the tokens it skipped); neither
        is a cost of drafting k. The per-token draft cost (the prior) is clipped to twice its
        estimate for the same reason."""
        last, self._last_k = self._last_k, k
        if k > 0:
            self._draft_samples += 1
            if self._draft_samples == 1:
                return
            if self.forward_s > 0:
                cost = draft_s / k / self.forward_s
                self.draft_cost = cost if self._draft_samples == 2 else 0.8 * self.draft_cost + 0.2 * min(cost, 2 * self.draft_cost)
            if last == 0:
                return
        t = self.times.setdefault(k, StepTime())
        t.seconds = self.time_decay * t.seconds + draft_s + verify_s
        t.weight = self.time_decay * t.weight + 1.0
