"""The bench's runs: every workload's prompts through plain decoding and every method,
interleaved in one process (per prompt: plain, then the methods in an order rotated by the
prompt's index), so machine noise lands on all of them alike.

Each method gets its own `LLM` over the *same* verifier weights (its own drafter cache),
so alternating methods never rebuilds a drafter. Warm-up runs (a short prompt through
every engine: kernel builds, drafter loads, auto-k's cost curve) happen before any timing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from forerun.bench.cell import PairRun
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ForerunError
from forerun.llm import LLM


@dataclass
class Method:
    label: str  # "ngram k=5": a cell's name in the report and the resume key
    spec: SpeculativeConfig
    llm: LLM  # the verifier's weights, this method's drafter

    @property
    def k(self):
        return self.spec.num_speculative_tokens


@dataclass
class Workload:
    category: str
    prompts: list[tuple[str, list[int]]]  # (prompt id, token ids as fed to the model)
    # prompt id -> its user turns, for prompts played as sessions (`forerun bench --turns`): turn
    # n resends turns 1 .. n - 1 with plain decoding's answers (the same under greedy decoding)
    sessions: dict[str, tuple[str, ...]] = field(default_factory=dict)


def method_label(spec: SpeculativeConfig) -> str:
    """A cell's name from its config.
    >>> method_label(SpeculativeConfig("ngram", 5)), method_label(SpeculativeConfig("ngram", 5, ngram_branches=3))
    ('ngram k=5', 'ngram tree x3 k=5')
    """
    extra = f" tree x{spec.ngram_branches}" if spec.method == "ngram" and spec.ngram_branches > 1 else ""
    extra += " + draft model" if spec.method == "suffix" and spec.draft_model is not None else ""
    lossy = f" {spec.acceptance}" if spec.acceptance != "exact" else ""  # a lossy cell says so in its name
    return f"{spec.method}{extra}{lossy} k={spec.num_speculative_tokens}"


def make_methods(verifier: LLM, specs: list[SpeculativeConfig], labels: list[str] | None = None) -> list[Method]:
    """One Method per config, sharing the verifier's weights and tokenizer; a draft_model's
    draft model named by a string is loaded once and shared by every config naming it.
    Labels (default: method_label) are the cells' keys, so two configs that differ only in
    their draft model get its name too ("draft_model k=5 (smollm2-135m)")."""
    labels = labels or [method_label(s) for s in specs]
    drafts: dict[tuple, LLM] = {}
    out = []
    for spec, label in zip(specs, labels):
        if labels.count(label) > 1 and spec.draft_model is not None:
            label += f" ({getattr(spec.draft_model, 'name', spec.draft_model)})"
        if any(m.label == label for m in out):
            raise ForerunError(f"{label} is listed twice")
        if spec.method in ("draft_model", "suffix") and isinstance(spec.draft_model, str):  # (medusa / eagle: a head folder)
            key = (spec.draft_model, spec.draft_dtype or verifier.dtype)
            if key not in drafts:
                drafts[key] = LLM(model=spec.draft_model, dtype=key[1], speculative=None, progress=False,
                                  enable_prefix_caching=False)  # (runs of the same prompts are timed)
            spec = dataclasses.replace(spec, draft_model=drafts[key])
        wrapper = LLM(model=verifier.model, dtype=verifier.dtype, tokenizer=verifier.tokenizer, speculative=spec,
                      enable_prefix_caching=False)
        wrapper.name, wrapper.source = verifier.name, verifier.source  # same weights: layer-skip profiles key on the name
        out.append(Method(label, spec, wrapper))
    return out


def warm_up(verifier: LLM, methods: list[Method], ids: list[int]) -> dict[str, str]:
    """Build every drafter and warm every path (a full-length prefill included) on one
    prompt before anything is timed. Returns {label: why} for the methods whose drafter
    cannot run on this verifier (a ForerunError: `quantized` under an int8 verifier,
    `layer_skip` without a tune-skip profile), for the caller to leave out or refuse."""
    params = SamplingParams(temperature=0, max_tokens=6)
    verifier.generate([ids], params, speculative=None)
    failed = {}
    for m in methods:
        try:
            m.llm.generate([ids], params, speculative=m.spec)
        except ForerunError as e:
            failed[m.label] = str(e)
    return failed


def refuse(failed: dict[str, str]):
    """For callers that need every method: the first drafter that could not run, as the error."""
    if failed:
        label, why = next(iter(failed.items()))
        raise ForerunError(f"{label}: {why}")


def run_workload(verifier: LLM, methods: list[Method], work: Workload, params: SamplingParams,
                 tick: Callable[[], None] = lambda: None) -> dict[str, list[PairRun]]:
    """Per prompt (and per turn of a session): one plain run, shared as the baseline of every
    method's pair, and one run per method; `tick` is called after each run (a progress bar)."""
    pairs: dict[str, list[PairRun]] = {m.label: [] for m in methods}
    for i, (pid, ids) in enumerate(work.prompts):
        turns = work.sessions.get(pid, ())
        history: list[dict] = []
        answer = ""  # plain decoding's answer to the turn before
        for t in range(max(1, len(turns))):
            if t:  # the next turn resends the conversation so far
                history += [{"role": "user", "content": turns[t - 1]}, {"role": "assistant", "content": answer}]
                ids = verifier.encode([verifier.apply_chat_template(history + [{"role": "user", "content": turns[t]}])])[0]
            runs = _rotation(verifier, methods, i + t, ids, params, tick)
            plain, answer = runs[None], verifier.decode(runs[None].token_ids)
            for m in methods:
                out = runs[m.label]
                pairs[m.label].append(PairRun(pid if not t else f"{pid}#turn{t + 1}", plain.stats, out.stats,
                                              plain.token_ids, out.token_ids))
    return pairs


def _rotation(verifier: LLM, methods: list[Method], i: int, ids: list[int], params: SamplingParams, tick) -> dict:
    """Plain and every method on one prompt, in an order rotated by i: {label (None = plain): output}."""
    order = methods[i % len(methods):] + methods[: i % len(methods)] if methods else []
    plain_at = i % (len(methods) + 1)  # where plain runs in this prompt's rotation
    runs = {}
    for m in order[:plain_at] + [None] + order[plain_at:]:
        llm, spec = (verifier, None) if m is None else (m.llm, m.spec)
        runs[None if m is None else m.label] = llm.generate([ids], params, speculative=spec)[0]
        tick()
    return runs
