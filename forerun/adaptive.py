"""Adaptive speculation (`num_speculative_tokens="auto"`): each step, each row drafts the k
that maximises expected tokens per second, from an online estimate of its acceptance rate
and a measured cost model. k = 0 (plain decoding) is a choice like any other, so a drafter
that does not pay on some text is switched off there, and probed again now and then.

The model, per step of a row that drafts k tokens:
    tokens(k) = (1 - a^(k+1)) / (1 - a)            expected tokens emitted (Leviathan et al.),
                                                    a = per-token acceptance probability
    time(k)   = verify(k + 1) + k * draft           in units of one 1-token verifier forward
with verify(T) the measured forward cost of scoring T tokens (`bench.cost.measure`) and
draft the drafter's measured time per drafted token. Verification is untouched, so every
choice of k keeps the output exact: only speed depends on this module.
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


def best_k(alpha: float, verify_cost: list[float], draft_cost: float, k_max: int) -> int:
    """argmax over k in [0, k_max] of tokens(k) / time(k); verify_cost[t] = cost of scoring
    t + 1 tokens relative to one token (verify_cost[0] == 1).
    >>> best_k(0.9, [1.0] * 9, 0.05, 8), best_k(0.2, [1.0, 1.3, 1.6], 0.5, 2)
    (8, 0)
    """
    rates = [expected_tokens(alpha, k) / (verify_cost[k] + k * draft_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


@dataclass
class RowEstimate:
    """Discounted counts of accepted draft tokens and of rejections (a step that stopped
    before the end of its draft), with a weak prior of acceptance 0.5."""

    accepted: float = 1.0
    rejected: float = 1.0
    idle: int = 0  # consecutive steps at k = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class AdaptiveK:
    k_max: int
    verify_cost: list[float]  # [k_max + 1]: cost of scoring t + 1 tokens / one token
    decay: float = 0.9  # per step: about the last 10 steps count
    probe_every: int = 8  # after this many steps at k = 0, draft 1 token to re-measure
    forward_s: float = 0.0  # measured seconds of a one-token verifier forward
    draft_cost: float = 0.0  # drafter seconds per drafted token / forward_s (measured as it runs)
    rows: dict[int, RowEstimate] = field(default_factory=dict)
    _draft_samples: int = 0

    def k_for(self, row: int) -> int:
        est = self.rows.setdefault(row, RowEstimate())
        k = best_k(est.alpha, self.verify_cost, self.draft_cost, self.k_max)
        if k == 0:
            est.idle += 1
            if est.idle >= self.probe_every:
                est.idle = 0
                return 1
        return k

    def update(self, row: int, drafted: int, accepted: int) -> None:
        """After a step: `accepted` of `drafted` tokens kept (drafted 0: nothing learned)."""
        if drafted <= 0:
            return
        est = self.rows.setdefault(row, RowEstimate())
        est.accepted = self.decay * est.accepted + accepted
        est.rejected = self.decay * est.rejected + (1.0 if accepted < drafted else 0.0)
        if accepted:
            est.idle = 0

    def observe_draft_time(self, seconds_per_token: float, weight: float = 0.2) -> None:
        """Blend in a measured drafter time per drafted token. The first call of a generate
        is skipped: a drafter that keeps its own cache feeds it the whole prompt then, which
        is not a cost of drafting. Later samples are clipped to twice the estimate, for the
        same reason (a probe after many k = 0 steps first catches up on those tokens)."""
        self._draft_samples += 1
        if self.forward_s <= 0 or self._draft_samples == 1:
            return
        cost = seconds_per_token / self.forward_s
        if self._draft_samples == 2:
            self.draft_cost = cost
        else:
            self.draft_cost = (1 - weight) * self.draft_cost + weight * min(cost, 2 * self.draft_cost)
