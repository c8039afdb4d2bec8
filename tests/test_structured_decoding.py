"""Structured outputs through LLM.generate, on a tiny random model with a tiny byte-level
tokenizer: every output follows its schema / regex / choice; speculative decoding (every
drafter, chains and trees, with and without the grammar's forced drafts) gives plain
constrained decoding's tokens; forced tokens are drafted and kept apart from the drafter's
figures; sampling keeps the constrained distribution (chi-square against the exact law)."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

from forerun import engine
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.constrain import shape_draft
from forerun.drafters.base import Draft
from forerun.errors import FieldError
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.sampling import logits_to_probs
from forerun.structured import StructuredOutputs
from forerun.tokenizer import Tokenizer
from tests.stats_util import chi2_pvalue
from tests.tiny import tiny_model
from tests.tiny_tokenizer import tiny_tokenizer_dir

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "ok", "n"], "additionalProperties": False}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 101, 102], [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def make_llm(tok, seed=0, scale=2.0) -> LLM:
    return LLM(tiny_model(seed=seed, vocab_size=tok.vocab_size, logit_scale=scale), tokenizer=tok)


@pytest.fixture(scope="module")
def llm(tok):
    return make_llm(tok)


def greedy(spec, max_tokens=60):
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec)


def test_outputs_follow_a_schema_a_regex_and_a_choice(llm, tok):
    outs = llm.generate(PROMPTS, greedy(StructuredOutputs(json=ITEM)), speculative=None)
    for o in outs:
        assert o.finish_reason == "stop", o
        value = json.loads(tok.decode(o.token_ids))
        assert set(value) == {"name", "ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
        assert len(value["name"]) <= 6
    text = tok.decode(llm.generate(PROMPTS[:1], greedy(StructuredOutputs(regex=r"[a-c]{2,5}-[0-9]+")))[0].token_ids)
    assert re.fullmatch(r"[a-c]{2,5}-[0-9]+", text), text
    out = llm.generate(PROMPTS[:1], greedy(StructuredOutputs(choice=["alpha", "beta"])))[0]
    assert tok.decode(out.token_ids) in ("alpha", "beta") and out.finish_reason == "stop"


def test_a_constrained_output_cut_by_max_tokens_says_length(llm):
    out = llm.generate(PROMPTS[:1], greedy(StructuredOutputs(json=ITEM), max_tokens=3), speculative=None)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_bad_constraints_are_refused_naming_the_field(llm):
    with pytest.raises(FieldError, match="structured_outputs.json"):
        llm.generate(PROMPTS[:1], greedy(StructuredOutputs(json={"type": "array", "uniqueItems": True})))


SPECS = {
    "ngram": lambda tok: SpeculativeConfig("ngram", 4, ngram_min=1),
    "ngram tree": lambda tok: SpeculativeConfig("ngram", 4, ngram_min=1, ngram_branches=3),
    "suffix": lambda tok: SpeculativeConfig("suffix", 6, options={"suffix_min_prob": 0.0}),
    "draft_model": lambda tok: SpeculativeConfig("draft_model", 3, draft_model=make_llm(tok, seed=3)),
    "draft_model tree": lambda tok: SpeculativeConfig("draft_model", 3, draft_model=make_llm(tok, seed=0), tree_width=2),
    "no forced drafts": lambda tok: SpeculativeConfig("ngram", 4, ngram_min=1, options={"grammar_drafts": False}),
    "suffix, not after forced": lambda tok: SpeculativeConfig("suffix", 6, options={"suffix_min_prob": 0.0,
                                                                                     "grammar_continue": False}),
}


@pytest.mark.parametrize("constraint", ["json", "regex"])
@pytest.mark.parametrize("name", list(SPECS))
def test_speculative_equals_plain_constrained_decoding(llm, tok, name, constraint):
    spec = StructuredOutputs(json=ITEM) if constraint == "json" else StructuredOutputs(regex=r"([a-e]{1,3} ){2,6}[0-9]{3}")
    plain = [o.token_ids for o in llm.generate(PROMPTS, greedy(spec), speculative=None)]
    outs = llm.generate(PROMPTS, greedy(spec), speculative=SPECS[name](tok))
    outs = llm.generate(PROMPTS, greedy(spec), speculative=SPECS[name](tok)) if name.startswith("suffix") else outs
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    if name == "no forced drafts":
        assert st.forced == 0
    elif constraint == "json":
        assert st.forced >= len(PROMPTS) * 3, st  # '{"', 'name', '":' at least, per row
    assert st.verifier_forwards < sum(map(len, plain))  # fewer forwards than tokens



class Recorder:
    """A drafter that proposes given tokens and keeps the requests it was asked."""

    def __init__(self, tokens: list[int], after: bool):
        self.tokens, self.drafts_after_forced, self.asked = tokens, after, []

    def propose(self, requests, params, generator):
        self.asked += requests
        return [Draft(self.tokens) for _ in requests]


@pytest.mark.parametrize("after, cont", [(True, True), (False, True), (True, False)])
def test_a_token_drafter_is_asked_to_continue_after_the_forced_run(llm, after, cont):
    """A drafter that drafts from tokens alone is asked about the committed tokens followed by
    the grammar's forced run, with the budget the run leaves; the draft is the run, then its
    tokens. Any other drafter (or any, with options["grammar_continue"] false) is asked about
    the committed tokens and its draft must begin with the run (here it does not: only the
    run is drafted)."""
    spec = StructuredOutputs(json=ITEM)
    out = llm.generate(PROMPTS[:1], greedy(spec), speculative=None)[0].token_ids
    matcher = llm.compile_grammar(spec).matcher()
    run = matcher.forced(8)
    assert 0 < len(run) < 6 and out[: len(run)] == run  # '{"name":"' then the free name
    follow_on = out[len(run) : len(run) + 2]
    rec = Recorder(follow_on, after)
    row = SimpleNamespace(row=0, tokens=list(PROMPTS[0]), remaining=50, prompt_len=len(PROMPTS[0]), tenant=b"",
                          penalties=None, matcher=matcher)
    job = SimpleNamespace(drafter=rec, k=8, k_policy=None, params=None, forced_drafts=True, continue_forced=cont)
    [draft] = engine._propose([row], job, None)
    [asked] = rec.asked
    if after and cont:
        assert asked.tokens == PROMPTS[0] + run and asked.k == 8 - len(run)
        assert draft.tokens == run + follow_on and draft.forced == len(run)
    else:
        assert asked.tokens == PROMPTS[0] and asked.k == 8
        assert draft.tokens == run and draft.forced == len(run)
    assert matcher.forced(8) == run  # the grammar's state is where it was


def test_a_sampled_draft_never_continues_a_forced_run(llm):
    spec = StructuredOutputs(json=ITEM)
    matcher = llm.compile_grammar(spec).matcher()
    run = matcher.forced(8)
    with pytest.raises(ValueError, match="deterministic"):
        shape_draft(matcher, Draft([1], torch.ones(1, 4) / 4), 8, run, after_run=True)

# -- sampling keeps the constrained law ---------------------------------------------------------------
N = 20_000
ALPHA = 1e-3
PROMPT = [7, 8, 9, 7, 8]
CHOICE = StructuredOutputs(choice=["ab", "abab", "ba", "name", "true", "b"])
PARAMS = dict(temperature=0.9, top_p=0.95, max_tokens=8)


def exact_law(llm, spec, params) -> dict[tuple, float]:
    """Every output's probability under plain constrained sampling, by enumeration: at each prefix
    the model's p masked by the grammar's state (EOS where the output may end)."""
    m, eos, law = llm.compile_grammar(spec).matcher(), llm.eos_ids(), {}

    def walk(prefix: tuple, mass: float):
        logits = llm.model.score(PROMPT + list(prefix), last_only=True)
        allowed = m.mask(logits.shape[-1])
        p = logits_to_probs(logits.masked_fill(~allowed, float("-inf")), params)
        for t in torch.nonzero(p > 0).flatten().tolist():
            if t in eos:
                law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + mass * float(p[t])
                continue
            assert m.advance(t)
            if m.is_done:
                law[prefix + (t,)] = mass * float(p[t])
            else:
                walk(prefix + (t,), mass * float(p[t]))
            m.rollback(1)

    walk((), 1.0)
    return law


@pytest.fixture(scope="module")
def small(tok):
    return make_llm(tok, seed=1, scale=0.5)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_sampling_keeps_the_constrained_distribution(small, tok, method):
    params = SamplingParams(**PARAMS, structured=CHOICE)
    law = exact_law(small, CHOICE, params)
    assert abs(sum(law.values()) - 1) < 1e-9 and len(law) >= 8
    spec = {"plain": None, "ngram": SpeculativeConfig("ngram", 3, ngram_min=1),
            "draft_model": SpeculativeConfig("draft_model", 3, draft_model=make_llm(tok, seed=4, scale=0.5))}[method]
    outs = small.generate([PROMPT] * N, SamplingParams(**PARAMS, structured=CHOICE, seed=11), speculative=spec)
    samples = [tuple(o.token_ids) for o in outs]
    if spec is not None:
        st = merge([o.stats for o in outs])
        assert st.forced > 0 or st.accepted > 0, st
    assert chi2_pvalue(samples, law) > ALPHA
