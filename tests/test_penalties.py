"""logit_bias and the repetition penalties: applied as OpenAI and vLLM define them, and exact
under speculation (every drafted position counts the draft tokens before it): greedy output
equals plain decoding's for every drafter, and sampled output keeps the penalized law."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.base import Draft
from forerun.engine import Sequence
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.penalties import Penalties, apply
from forerun.sampling import logits_to_probs
from tests.stats_util import chi2_pvalue
from tests.tiny import tiny_model

PEN = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3, logit_bias={3: 2.0, 5: -1.5})


def test_each_position_counts_the_draft_tokens_before_it():
    s = Sequence(0, [1, 2, 9, 9, 4], prompt_len=2, max_new=10)  # output so far: 9 9 4
    s.penalties = Penalties.of(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0))
    raw = torch.full((1, 3, 12), 1.0, dtype=torch.float64)
    out = apply(raw, raw, [s], [Draft([4, 7])])
    assert raw[0, 0, 0] == 1.0  # the raw logits are untouched (logprobs read them)
    # position 0 sees 9 x2, 4 x1; position 1 also the draft's 4; position 2 also its 7
    expect = lambda count, seen: (1.0 / 2.0 if seen else 1.0) - 1.0 * count - 0.5 * (count > 0)  # noqa: E731
    assert out[0, 0, 9] == expect(2, True) and out[0, 0, 4] == expect(1, True) and out[0, 0, 7] == expect(0, False)
    assert out[0, 1, 4] == expect(2, True) and out[0, 2, 7] == expect(1, True)
    assert out[0, 0, 1] == 0.5 and out[0, 0, 3] == 1.0  # a prompt token: repetition only


def test_bad_values_are_refused():
    for kw in ({"frequency_penalty": 3.0}, {"repetition_penalty": 0.0}, {"repetition_penalty": 3e-268},
               {"logit_bias": {-1: 1.0}}, {"logit_bias": {2: 500.0}}):
        with pytest.raises(ConfigError):
            SamplingParams(**kw)


def test_the_smallest_repetition_penalty_keeps_probabilities_finite():
    """At the least penalty accepted, float32 logits of a real model's size (|l| <= 40) divided by
    it stay finite, and so do the probabilities sampled from (a penalty that rounds to 0 in float32
    gave inf / NaN and a 500)."""
    from forerun.config import MIN_REPETITION_PENALTY

    params = SamplingParams(temperature=0.7, repetition_penalty=MIN_REPETITION_PENALTY)
    s = Sequence(0, [1, 2, 3, 4], prompt_len=2, max_new=10)
    s.penalties = Penalties.of(params)
    raw = torch.linspace(-40.0, 40.0, 64).repeat(1, 2, 1)
    out = apply(raw, raw, [s], [Draft([5])])
    probs = logits_to_probs(out, params)
    assert torch.isfinite(out).all() and torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(1, 2))


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1]]


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0))


@pytest.mark.parametrize("spec", [SpeculativeConfig("ngram", 4, ngram_min=1), SpeculativeConfig("ngram", 3, ngram_min=1, ngram_branches=3),
                                  SpeculativeConfig("suffix", 5, options={"suffix_min_prob": 0.0}), "draft"],
                         ids=["ngram", "ngram tree", "suffix", "draft_model"])
def test_greedy_speculation_equals_plain_with_penalties(verifier, spec):
    spec = SpeculativeConfig("draft_model", 3, draft_model=LLM(tiny_model(seed=0))) if spec == "draft" else spec
    params = SamplingParams(temperature=0, max_tokens=30, **PEN)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, params, speculative=None)]
    assert plain != [o.token_ids for o in verifier.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30))]
    outs = verifier.generate(PROMPTS, params, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).accepted > 0


N = 20_000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
SAMPLE = dict(temperature=0.8, top_p=0.95, max_tokens=4, **PEN)  # the prefill's token, then drafts of up to 2


def penalized_law(model, params) -> dict[tuple, float]:
    """The exact law of the first tokens (params.max_tokens) under plain sampling with the
    penalties, by enumeration."""
    law = {(): 1.0}
    for _ in range(params.max_tokens):
        nxt = {}
        for prefix, mass in law.items():
            s = Sequence(0, PROMPT + list(prefix), len(PROMPT), params.max_tokens)
            s.penalties = Penalties.of(params)
            logits = model.score(PROMPT + list(prefix), last_only=True)[None, None]
            p = logits_to_probs(apply(logits, logits, [s], [Draft([])])[0, 0], params)
            for t in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (t,)] = mass * float(p[t])
        law = nxt
    return law


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_keeps_the_penalized_law(method):
    llm = LLM(tiny_model(seed=0, vocab_size=8, logit_scale=1.0))
    params = SamplingParams(**SAMPLE)
    law = penalized_law(llm.model, params)
    spec = SpeculativeConfig("ngram", 3, ngram_min=1) if method == "ngram" else \
        SpeculativeConfig("draft_model", 3, draft_model=LLM(tiny_model(seed=7, vocab_size=8, logit_scale=1.0)))
    outs = llm.generate([PROMPT] * N, SamplingParams(**SAMPLE, seed=3), speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0, st
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], law) > 1e-3
