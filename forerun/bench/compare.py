"""Plain vs speculative decoding, side by side in one process, on a prompt set.

Runs alternate (plain first on even prompts, speculative first on odd ones) so that
machine noise lands on both. Speedup is summed plain wall time / summed speculative
wall time, prefill included, as a user would see it, with a 95% bootstrap interval over
prompts and a verdict (faster / slower / within noise).
"""
from __future__ import annotations

from dataclasses import dataclass


from forerun.bench.spread import ratio_interval, verdict
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.metrics import SpecStats, merge
from forerun.prompts import Prompt


@dataclass
class PromptRun:
    prompt: Prompt
    ids: list[int]  # the prompt's token ids as fed to the model
    plain: list[int]  # generated token ids
    spec: list[int]
    plain_stats: SpecStats
    spec_stats: SpecStats

    @property
    def identical(self) -> bool:
        return self.plain == self.spec

    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.plain, self.spec)):
            if a != b:
                return i
        return None if len(self.plain) == len(self.spec) else min(len(self.plain), len(self.spec))


def prompt_ids(llm, prompt: Prompt) -> list[int]:
    text = llm.apply_chat_template([{"role": "user", "content": prompt.text}]) if prompt.chat else prompt.text
    return llm.encode([text])[0]


def run_pair(llm, prompt: Prompt, params: SamplingParams, spec: SpeculativeConfig, spec_first: bool) -> PromptRun:
    ids = prompt_ids(llm, prompt)
    order = [spec, None] if spec_first else [None, spec]
    outs = {}
    for which in order:
        outs[which is None] = llm.generate([ids], params, speculative=which)[0]
    plain, fast = outs[True], outs[False]
    return PromptRun(prompt, ids, plain.token_ids, fast.token_ids, plain.stats, fast.stats)


def top2_gap(llm, ids: list[int], generated: list[int], pos: int) -> float:
    """Verifier's top-1 minus top-2 logit where the plain run chose generated[pos]:
    a small gap means a near-tie that lower precision can flip."""
    logits = llm.model.score(ids + generated[:pos], last_only=True)
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def summarize(llm, runs: list[PromptRun], params: SamplingParams, spec: SpeculativeConfig) -> dict:
    plain, fast = merge([r.plain_stats for r in runs]), merge([r.spec_stats for r in runs])
    plain_s, spec_s = [r.plain_stats.wall_time for r in runs], [r.spec_stats.wall_time for r in runs]
    t_plain, t_spec = sum(plain_s), sum(spec_s)
    matches = [r.identical for r in runs]
    low, high = ratio_interval(plain_s, spec_s)
    return {
        "method": spec.method,
        "k": spec.num_speculative_tokens,
        "dtype": llm.dtype,
        "n_prompts": len(runs),
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "autoregressive": _side(plain),
        "speculative": {
            **_side(fast),
            "acceptance_rate": fast.acceptance_rate,
            "mean_accepted_length": fast.mean_accepted_length,
            "drafted": fast.drafted,
            "accepted": fast.accepted,
            "accepted_at_position": fast.accepted_at,
            "draft_time_s": fast.draft_time,
            "verify_time_s": fast.verify_time,
            "draft_cost_vs_verifier_forward": _draft_cost(plain, fast),
        },
        "speedup": t_plain / t_spec if t_spec > 0 else None,
        "speedup_ci95": [low, high],  # bootstrap over prompts
        "verdict": verdict(low, high),
        "identical": all(matches) if params.greedy else None,
        "match_share": sum(matches) / len(runs) if params.greedy and runs else None,
        "divergences": _divergences(llm, runs) if params.greedy else [],
        "per_prompt": [_row(r) for r in runs],
    }


def _draft_cost(plain: SpecStats, fast: SpecStats) -> float | None:
    """Drafter time per step / one plain verifier forward (decode time per plain step)."""
    if not fast.verifier_forwards or not plain.verifier_forwards or plain.decode_time <= 0:
        return None
    return (fast.draft_time / fast.verifier_forwards) / (plain.decode_time / plain.verifier_forwards)


def _side(s: SpecStats) -> dict:
    return {
        "tokens_per_s": s.tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "generated_tokens": s.generated,
        "verifier_forwards": s.verifier_forwards,
        "prefill_time_s": s.prefill_time,
        "decode_time_s": s.decode_time,
    }


def _divergences(llm, runs: list[PromptRun]) -> list[dict]:
    out = []
    for r in runs:
        pos = r.first_divergence()
        if pos is not None and pos < len(r.plain):
            out.append({"id": r.prompt.id, "position": pos, "top2_logit_gap": top2_gap(llm, r.ids, r.plain, pos)})
    return out


def _row(r: PromptRun) -> dict:
    return {
        "id": r.prompt.id,
        "category": r.prompt.category,
        "prompt_tokens": len(r.ids),
        "plain_tokens_per_s": r.plain_stats.tokens_per_s,
        "spec_tokens_per_s": r.spec_stats.tokens_per_s,
        "acceptance_rate": r.spec_stats.acceptance_rate,
        "mean_accepted_length": r.spec_stats.mean_accepted_length,
        "identical": r.identical,
    }


def top1_agreement(model_a, model_b, ids: list[int]) -> float:
    """Share of positions where two models' argmax agree on one fixed text (teacher forced)."""
    preds = [m.score(ids).argmax(-1) for m in (model_a, model_b)]
    return float((preds[0] == preds[1]).double().mean())

