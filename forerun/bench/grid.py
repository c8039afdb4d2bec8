"""The bench's runs: every workload's prompts through plain decoding and every method,
interleaved in one process (per prompt: plain, then the methods in an order rotated by the
prompt's index), so machine noise lands on all of them alike.

Each method gets its own `LLM` over the *same* verifier weights (its own drafter cache),
so alternating methods never rebuilds a drafter. Warm-up runs (a short prompt through
every engine: kernel builds, drafter loads, auto-k's cost curve) happen before any timing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from forerun.bench.cell import PairRun
from forerun.config import SamplingParams, SpeculativeConfig
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


def method_label(spec: SpeculativeConfig) -> str:
    """>>> method_label(SpeculativeConfig("ngram", 5))
    'ngram k=5'
    """
    extra = f" tree x{spec.ngram_branches}" if spec.method == "ngram" and spec.ngram_branches > 1 else ""
    return f"{spec.method}{extra} k={spec.num_speculative_tokens}"


def make_methods(verifier: LLM, specs: list[SpeculativeConfig]) -> list[Method]:
    """One Method per config, sharing the verifier's weights and tokenizer; a draft model
    named by a string is loaded once and shared by every config naming it."""
    drafts: dict[tuple, LLM] = {}
    out = []
    for spec in specs:
        if isinstance(spec.draft_model, str):
            key = (spec.draft_model, spec.draft_dtype or verifier.dtype)
            if key not in drafts:
                drafts[key] = LLM(model=spec.draft_model, dtype=key[1], speculative=None, progress=False)
            spec = dataclasses.replace(spec, draft_model=drafts[key])
        wrapper = LLM(model=verifier.model, dtype=verifier.dtype, tokenizer=verifier.tokenizer, speculative=spec)
        out.append(Method(method_label(spec), spec, wrapper))
    return out


def warm_up(verifier: LLM, methods: list[Method], ids: list[int]):
    """Build every drafter and warm every path (a full-length prefill included) on one
    prompt before anything is timed."""
    params = SamplingParams(temperature=0, max_tokens=6)
    verifier.generate([ids], params, speculative=None)
    for m in methods:
        m.llm.generate([ids], params, speculative=m.spec)


def run_workload(verifier: LLM, methods: list[Method], work: Workload, params: SamplingParams,
                 tick: Callable[[], None] = lambda: None) -> dict[str, list[PairRun]]:
    """Per prompt: one plain run, shared as the baseline of every method's pair, and one run
    per method; `tick` is called after each run (a progress bar)."""
    pairs: dict[str, list[PairRun]] = {m.label: [] for m in methods}
    for i, (pid, ids) in enumerate(work.prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)] if methods else []
        plain_at = i % (len(methods) + 1)  # where plain runs in this prompt's rotation
        runs = {}
        for m in order[:plain_at] + [None] + order[plain_at:]:
            llm, spec = (verifier, None) if m is None else (m.llm, m.spec)
            runs[None if m is None else m.label] = llm.generate([ids], params, speculative=spec)[0]
            tick()
        plain = runs[None]
        for m in methods:
            out = runs[m.label]
            pairs[m.label].append(PairRun(pid, plain.stats, out.stats, plain.token_ids, out.token_ids))
    return pairs
