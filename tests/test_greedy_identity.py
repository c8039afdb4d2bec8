"""Greedy speculative decoding emits exactly plain decoding's tokens (tiny float64 models)."""
import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.tiny import tiny_model, truncated_copy

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0))


@pytest.fixture(scope="module")
def plain(verifier):
    return [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]


def _spec(method, k, verifier):
    if method == "ngram":
        return SpeculativeConfig("ngram", k, ngram_max=3)
    # an unrelated random model: low acceptance, many rejections
    return SpeculativeConfig("draft_model", k, draft_model=LLM(tiny_model(seed=3)))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_equals_plain(verifier, plain, method, k):
    outs = verifier.generate(PROMPTS, GREEDY, speculative=_spec(method, k, verifier))
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    assert st.drafted > 0 and st.verifier_forwards < st.generated + 1


def test_truncated_copy_drafter_accepts_often(verifier, plain):
    """The verifier's own first layer + head as a drafter: same vocab, correlated outputs."""
    spec = SpeculativeConfig("draft_model", 4, draft_model=LLM(truncated_copy(verifier.model, 1)))
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).accepted > 0


@pytest.mark.parametrize("p_min", [0.2, 0.6, 0.99])
def test_p_min_shortens_drafts_and_keeps_the_output(verifier, plain, p_min):
    base = SpeculativeConfig("draft_model", 4, draft_model=LLM(truncated_copy(verifier.model, 1)))
    full = merge([o.stats for o in verifier.generate(PROMPTS, GREEDY, speculative=base)])
    spec = SpeculativeConfig("draft_model", 4, draft_model=base.draft_model, options={"draft_p_min": p_min})
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted < full.drafted


def test_self_draft_accepts_everything(verifier, plain):
    outs = verifier.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig("draft_model", 4, draft_model=verifier))
    st = merge([o.stats for o in outs])
    assert [o.token_ids for o in outs] == plain
    assert st.accepted == st.drafted and st.rejections == 0


def test_catch_up_rides_in_the_first_draft_forward(verifier, plain):
    """After a fully accepted draft the drafter must feed two tokens (the last draft and the
    bonus); they go into the step's first forward, so every drafter forward past the prompts
    drafts exactly one token."""
    draft = LLM(tiny_model(seed=0))  # the verifier's weights in another module: all accepted
    widths = []
    forward = draft.model.forward

    def counted(batch, *a, **kw):
        widths.append(batch.tokens.shape[1])
        return forward(batch, *a, **kw)

    draft.model.forward = counted
    spec = SpeculativeConfig("draft_model", 4, draft_model=draft)
    for prompt, want in zip(PROMPTS, plain):
        widths.clear()
        out = verifier.generate([prompt], GREEDY, speculative=spec)[0]
        assert out.token_ids == want and out.stats.rejections == 0
        steps = widths[1:]  # the prompt is written first, on its own (in the prefill)
        assert max(steps) == 2 and len(steps) == out.stats.drafted  # one forward per drafted token


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 3), "draft"])
def test_batched_equals_one_by_one(verifier, spec):
    if spec == "draft":
        spec = SpeculativeConfig("draft_model", 3, draft_model=LLM(tiny_model(seed=3)))
    together = [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=spec)]
    alone = [verifier.generate([p], GREEDY, speculative=spec)[0].token_ids for p in PROMPTS]
    assert together == alone


def test_seeded_sampling_is_deterministic(verifier):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=123)
    spec = SpeculativeConfig("ngram", 3)
    a = [o.token_ids for o in verifier.generate(PROMPTS, params, speculative=spec)]
    b = [o.token_ids for o in verifier.generate(PROMPTS, params, speculative=spec)]
    c = [o.token_ids for o in verifier.generate(PROMPTS, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=124), speculative=spec)]
    assert a == b and a != c


def test_max_tokens_and_eos_are_exact(verifier, plain):
    out = verifier.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=7), speculative=SpeculativeConfig("ngram", 5))[0]
    assert out.token_ids == plain[0][:7] and out.finish_reason == "length"
    eos = plain[0][5]
    verifier.model.config.eos_token_id.append(eos)
    try:
        out = verifier.generate([PROMPTS[0]], GREEDY, speculative=SpeculativeConfig("ngram", 5))[0]
    finally:
        verifier.model.config.eos_token_id.remove(eos)
    first = plain[0].index(eos)
    assert out.token_ids == plain[0][: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("n_min", [1, 2])
def test_lookup_guesses_save_draft_forwards_and_keep_the_output(verifier, plain, n_min):
    """draft_lookup: the first forward also feeds prompt lookup's guess; where the drafter's own
    tokens agree with it, one forward drafts several tokens. The drafts, and so the output and
    the acceptance, are the drafter's as without it; only the forwards are fewer."""
    counts = {}
    for lookup in (0, n_min):
        draft = LLM(tiny_model(seed=0))  # the verifier's weights: its greedy answers repeat themselves
        forwards = []
        forward = draft.model.forward

        def counted(batch, *a, _forward=forward, _log=forwards, **kw):
            _log.append(batch.tokens.shape[1])
            return _forward(batch, *a, **kw)

        draft.model.forward = counted
        spec = SpeculativeConfig("draft_model", 4, draft_model=draft, options={"draft_lookup": lookup} if lookup else {})
        outs = [verifier.generate([p], GREEDY, speculative=spec)[0] for p in PROMPTS]  # (a batch's forwards: its longest row's)
        assert [o.token_ids for o in outs] == plain
        st = merge([o.stats for o in outs])
        counts[lookup] = (len(forwards), st.drafted, st.accepted)
    (off, drafted, accepted), (on, drafted_on, accepted_on) = counts[0], counts[n_min]
    assert (drafted_on, accepted_on) == (drafted, accepted)
    assert on < off


def test_lookup_option_is_checked(verifier):
    draft = LLM(tiny_model(seed=3))
    with pytest.raises(ConfigError, match="draft_lookup"):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("draft_model", 3, draft_model=draft,
                                                                         options={"draft_lookup": 9}))
