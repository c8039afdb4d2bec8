"""Adaptive k ("auto"): the controller's choice follows acceptance and cost, and the output
stays exactly the verifier's (greedy identity and the sampled law), whatever k it picks."""
import random

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
    assert ks == [0, 1, 0, 0, 1, 0]  # off, with 1-token probes after 2, then every 3 steps
    policy.observe_step(2, 30.0, 1.0)  # the first drafting step: the drafter's prompt catch-up, ignored
    assert policy.draft_cost == 0.0 and not policy.times
    policy.observe_step(1, 0.5, 1.0)
    policy.observe_step(1, 1.0, 1.0)
    assert 0.5 < policy.draft_cost < 1.0 and 1.5 < policy.times[1].mean < 2.0
    policy.observe_step(0, 0.0, 1.0)
    policy.observe_step(1, 50.0, 1.0)  # right after k = 0: a catch-up, not k = 1's time; clipped in the prior
    assert policy.draft_cost < 1.0 and policy.times[1].mean < 2.0 and policy.times[0].mean == 1.0


def test_measured_step_times_overrule_the_prior():
    """The 0.5B Qwen drafting for the 1.5B over a 1,500-token context: the drafter took 21 /
    30 / 44 ms a step at k 1 / 2 / 3 (not proportional to k) and the verifier's forwards were
    slower than the short-context curve says. With acceptance 0.8 the best k is 2; the prior
    alone (seconds per drafted token measured at k = 1, times k) would hold k = 1."""
    verify = [0.062, 0.069, 0.084, 0.098, 0.115]  # seconds to score 1 .. 5 tokens
    draft = [0.0, 0.021, 0.0295, 0.044, 0.058]  # drafter seconds a step at k 0 .. 4
    alpha = 0.8
    rates = [expected_tokens(alpha, k) / (verify[k] + draft[k]) for k in range(5)]
    assert max(range(5), key=rates.__getitem__) == 2
    assert best_k(alpha, [1.0, 1.0, 1.2, 1.4, 1.7], draft[1] / verify[0]) == 1  # the prior's choice
    policy = AdaptiveK(4, [1.0, 1.0, 1.2, 1.4, 1.7], forward_s=verify[0])
    rng, tokens, seconds = random.Random(0), 0, 0.0
    for step in range(400):
        k = policy.k_for(0)
        accepted = next((i for i in range(k) if rng.random() > alpha), k)
        policy.update(0, k, accepted)
        policy.observe_step(k, draft[k], verify[k])
        if step >= 200:  # (the probes of k - 1 and k + 1 included)
            tokens, seconds = tokens + accepted + 1, seconds + verify[k] + draft[k]
    assert tokens / seconds > 1.03 * rates[1] and tokens / seconds > 0.97 * rates[2]


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
