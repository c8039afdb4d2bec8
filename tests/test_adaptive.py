"""Adaptive k ("auto"): the controller's choice follows acceptance and cost, and the output
stays exactly the verifier's (greedy identity and the sampled law), whatever k it picks."""
import pytest

from forerun.adaptive import AdaptiveK, best_k, expected_tokens
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model


def test_the_choice_follows_acceptance_and_cost():
    flat = [1.0] * 9
    assert best_k(0.95, flat, 0.0, 8) == 8  # free drafts, high acceptance: the longest
    assert best_k(0.05, [1.0 + 0.3 * t for t in range(9)], 0.0, 8) == 0  # verifying more costs more than it yields
    assert best_k(0.8, flat, 0.6, 8) < best_k(0.8, flat, 0.05, 8)  # an expensive drafter drafts less
    assert expected_tokens(0.5, 0) == 1.0


def test_the_estimate_learns_and_k_zero_is_probed_again():
    policy = AdaptiveK(4, [1.0, 1.5, 2.0, 2.5, 3.0], probe_every=3, forward_s=1.0)
    for _ in range(20):
        policy.update(0, 4, 4)
    assert policy.rows[0].alpha > 0.9
    for _ in range(20):
        policy.update(1, 4, 0)
    ks = [policy.k_for(1) for _ in range(6)]
    assert ks.count(0) == 4 and ks.count(1) == 2  # off, with a 1-token probe every 3rd step
    policy.observe_draft_time(30.0)  # the first call: the drafter's prompt catch-up, ignored
    assert policy.draft_cost == 0.0
    policy.observe_draft_time(0.5)
    policy.observe_draft_time(1.0)
    assert 0.5 < policy.draft_cost < 1.0
    policy.observe_draft_time(50.0)  # a catch-up after many k = 0 steps: clipped
    assert policy.draft_cost < 1.0


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4] * 20]


@pytest.mark.parametrize("dtype", ["float64", "int8"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_auto_keeps_greedy_output(dtype, method):
    verifier = LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=3), dtype=dtype)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    extra = {"draft_model": LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=2), dtype=dtype)} if method == "draft_model" else None
    spec = SpeculativeConfig(method, "auto", draft_model=extra and extra["draft_model"], options={"k_max": 6})
    outs = verifier.generate(PROMPTS, greedy, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


def test_auto_keeps_the_sampled_law():
    prompt, params = [1, 2, 3, 1, 2, 3, 1, 2], dict(temperature=0.8, top_p=0.9, max_tokens=4)
    verifier = LLM(tiny_model(seed=0, vocab_size=8))
    reference = joint_distribution(verifier.model, prompt, SamplingParams(**params), n=4)
    # a flat cost curve (as on a memory-bound verifier): the controller drafts, and varies k
    spec = SpeculativeConfig("draft_model", "auto", draft_model=LLM(tiny_model(seed=7, vocab_size=8)),
                             options={"k_max": 3, "verify_cost": [1.0, 1.0, 1.05, 1.1]})
    outs = verifier.generate([prompt] * 20_000, SamplingParams(**params, seed=9), speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3


def test_auto_is_validated():
    assert SpeculativeConfig("ngram", "auto").k_max == 8 and SpeculativeConfig("ngram", "auto").enabled
    with pytest.raises(ConfigError, match="integer >= 0 or 'auto'"):
        SpeculativeConfig("ngram", "fast")
    with pytest.raises(ConfigError, match="k_max"):
        SpeculativeConfig("ngram", "auto", options={"k_max": 0})
