"""One bench cell (a workload x a method): the figures the report and the advisor read.

Vocabulary (verify.py's): a step drafts L tokens, the verifier keeps n of them and emits
one more (recovered or bonus), so a step emits n + 1 tokens and tau = tokens / steps.

Predicted tau (Leviathan et al.): if each draft token is accepted with probability alpha,
independently, a step drafting L tokens emits 1 + alpha + ... + alpha^L tokens on average,
(1 - alpha^(L+1)) / (1 - alpha) for a fixed L = k. alpha is estimated per token as
accepted / (accepted + rejections) (each step is a run of Bernoulli trials stopped at the
first refusal, or at the end of its draft), and the prediction sums over the draft lengths
actually drafted (`drafted_at`), so empty drafts (no n-gram match, auto's k = 0) count as
the 1-token steps they were. A prediction well above the observed tau means acceptances
cluster (the first draft token is refused far more often than later ones).
"""
from __future__ import annotations

from dataclasses import dataclass

from forerun.bench.spread import ratio_interval, verdict
from forerun.metrics import SpecStats, merge


@dataclass
class PairRun:
    """One prompt, decoded plainly and by the method, back to back."""

    prompt_id: str
    plain: SpecStats
    spec: SpecStats
    plain_tokens: list[int]
    spec_tokens: list[int]


def alpha(s: SpecStats) -> float:
    """Per-token acceptance probability (see the module docstring).
    >>> alpha(SpecStats(accepted=6, rejections=2))
    0.75
    """
    trials = s.accepted + s.rejections
    return s.accepted / trials if trials else 0.0


def predicted_tau(s: SpecStats) -> float:
    """Expected tokens per verifier forward from alpha and the measured draft lengths.
    A fixed k = 2 with alpha 0.5 in every step gives (1 - 0.5^3) / 0.5 = 1.75:
    >>> predicted_tau(SpecStats(verifier_forwards=4, drafted_at=[4, 4], accepted=4, rejections=4))
    1.75
    """
    if not s.verifier_forwards:
        return 0.0
    a = alpha(s)
    expected = s.verifier_forwards + sum(n * a ** (i + 1) for i, n in enumerate(s.drafted_at))
    return expected / s.verifier_forwards


def position_acceptance(s: SpecStats) -> list[float]:
    """Per draft position i: share of the drafts reaching position i whose token i was kept
    (falls with i as a refusal ends the step).
    >>> position_acceptance(SpecStats(accepted_at=[3, 1], drafted_at=[4, 4]))
    [0.75, 0.25]
    """
    return [a / d if d else 0.0 for a, d in zip(s.accepted_at, s.drafted_at)]


def time_split(s: SpecStats) -> dict[str, float]:
    """Seconds of a run: prefill, drafting, verification (forwards + acceptance) and the
    rest of decoding (commit, stop checks, Python)."""
    overhead = max(0.0, s.decode_time - s.draft_time - s.verify_time)
    return {"prefill_s": s.prefill_time, "draft_s": s.draft_time, "verify_s": s.verify_time, "overhead_s": overhead}


def draft_cost(plain: SpecStats, spec: SpecStats) -> float | None:
    """The drafter's seconds per step over one plain step's seconds (a verifier forward
    and its bookkeeping): what a draft costs in verifier forwards.
    >>> draft_cost(SpecStats(verifier_forwards=10, decode_time=1.0), SpecStats(verifier_forwards=4, draft_time=0.2))
    0.5
    """
    if not spec.verifier_forwards or not plain.verifier_forwards or plain.decode_time <= 0:
        return None
    return (spec.draft_time / spec.verifier_forwards) / (plain.decode_time / plain.verifier_forwards)


def summarize_cell(category: str, label: str, k, pairs: list[PairRun], greedy: bool) -> dict:
    """The cell's figures; speedup = summed plain wall time / summed method wall time with
    a 95% bootstrap interval over prompts."""
    plain, spec = merge([p.plain for p in pairs]), merge([p.spec for p in pairs])
    t_plain, t_spec = [p.plain.wall_time for p in pairs], [p.spec.wall_time for p in pairs]
    low, high = ratio_interval(t_plain, t_spec)
    same = [p.plain_tokens == p.spec_tokens for p in pairs]
    return {
        "category": category, "method": label, "k": k, "n_prompts": len(pairs),
        "plain_tokens_per_s": plain.tokens_per_s, "tokens_per_s": spec.tokens_per_s,
        "plain_decode_tokens_per_s": plain.decode_tokens_per_s, "decode_tokens_per_s": spec.decode_tokens_per_s,
        "speedup": sum(t_plain) / sum(t_spec) if sum(t_spec) > 0 else None,
        "speedup_ci95": [low, high], "verdict": verdict(low, high),
        "acceptance_rate": spec.acceptance_rate, "alpha": alpha(spec),
        "acceptance_by_position": position_acceptance(spec),
        "tau": spec.mean_accepted_length, "predicted_tau": predicted_tau(spec),
        "drafted_per_step": spec.drafted / spec.verifier_forwards if spec.verifier_forwards else 0.0,
        "steps": spec.verifier_forwards, "plain_steps": plain.verifier_forwards, "draft_cost": draft_cost(plain, spec),
        "time_split": time_split(spec), "plain_time_split": time_split(plain),
        "identical": all(same) if greedy else None, "match_share": sum(same) / len(same) if greedy and same else None,
        "per_prompt": [_row(p) for p in pairs],
    }


def _row(p: PairRun) -> dict:
    return {
        "id": p.prompt_id, "plain_s": p.plain.wall_time, "spec_s": p.spec.wall_time,
        "plain_tokens": p.plain.generated, "spec_tokens": p.spec.generated,
        "acceptance_rate": p.spec.acceptance_rate, "tau": p.spec.mean_accepted_length,
        "identical": p.plain_tokens == p.spec_tokens,
    }
