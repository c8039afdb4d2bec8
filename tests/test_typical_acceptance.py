"""Medusa's typical acceptance: opt-in, named lossy, and really lossy (it changes the output
law, which is why it is never the default); greedy decoding stays exact under it."""
import math

import pytest
import torch

from forerun.bench.grid import method_label
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.sampling import make_generator
from forerun.verify import TypicalRule, rejection_verify, typical_threshold, typical_tree_verify_lossy, typical_verify_lossy
from tests.tiny import tiny_model

RULE = TypicalRule(epsilon=0.09, alpha=0.3)


def test_the_threshold_is_the_smaller_of_epsilon_and_the_entropy_term():
    flat = torch.full((8,), 1 / 8)  # H = log 8: alpha / 8 = 0.0375 < epsilon
    assert math.isclose(float(typical_threshold(flat, RULE)), 0.3 / 8, rel_tol=1e-6)
    sharp = torch.tensor([1.0, 0.0, 0.0])  # H = 0: alpha = 0.3, capped at epsilon
    assert math.isclose(float(typical_threshold(sharp, RULE)), 0.09, rel_tol=1e-6)


def test_a_prefix_of_typical_tokens_is_kept_and_the_next_token_comes_from_p():
    p = torch.tensor([[[0.5, 0.45, 0.05], [0.05, 0.9, 0.05], [0.96, 0.02, 0.02], [0.0, 0.0, 1.0]]])
    # drafts: 1 (p .45, typical), 1 (p .9), 1 (p .02 < 0.09: atypical) -> 2 kept, next ~ p[2] = token 0 w.p. .96
    r = typical_verify_lossy(torch.tensor([[1, 1, 1]]), torch.tensor([3]), p, RULE, make_generator(0, torch.device("cpu")))
    assert r.num_accepted.tolist() == [2]
    assert r.next_token.tolist()[0] in (0, 1, 2)
    full = typical_verify_lossy(torch.tensor([[1, 1, 0]]), torch.tensor([3]), p, RULE, None)
    assert full.num_accepted.tolist() == [3] and full.next_token.tolist() == [2]  # the bonus from p[3]
    padded = typical_verify_lossy(torch.tensor([[1, 1, 0]]), torch.tensor([1]), p, RULE, None)
    assert padded.num_accepted.tolist() == [1]  # padding is never kept


def test_it_is_lossy_where_exact_rejection_sampling_is_not():
    """p = (0.6, 0.4), a deterministic draft of token 1: exact verification emits 1 with
    probability 0.4; typical acceptance keeps it every time (0.4 is typical)."""
    p = torch.tensor([[[0.6, 0.4], [0.5, 0.5]]], dtype=torch.float64)
    draft, lens, n = torch.tensor([[1]]), torch.tensor([1]), 4000
    g = make_generator(1, torch.device("cpu"))
    exact = sum(int(rejection_verify(draft, lens, None, p, g).num_accepted) for _ in range(n)) / n
    typical = sum(int(typical_verify_lossy(draft, lens, p, RULE, g).num_accepted) for _ in range(n)) / n
    assert abs(exact - 0.4) < 0.04
    assert typical == 1.0


def test_the_tree_walk_follows_the_most_probable_typical_child():
    # node 0 (token 2) and node 1 (token 1) under the pending token; node 2 (token 0) under node 1
    target = torch.tensor([[0.1, 0.5, 0.4], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6]])
    r = typical_tree_verify_lossy([2, 1, 0], [-1, -1, 1], target, RULE, make_generator(0, torch.device("cpu")))
    assert r.path == [1, 2] and r.at_leaf  # token 1 (p .5) over token 2 (p .4); then token 0 (p .3)
    atypical = typical_tree_verify_lossy([0], [-1], torch.tensor([[0.01, 0.99], [0.5, 0.5]]), RULE, None)
    assert atypical.path == [] and atypical.next_token == 1 and not atypical.at_leaf


def test_it_is_opt_in_named_lossy_and_validated():
    assert SpeculativeConfig().acceptance == "exact" and SpeculativeConfig().typical_rule is None
    spec = SpeculativeConfig("ngram", 3, acceptance="typical_lossy", options={"typical_epsilon": 0.2, "typical_alpha": 0.5})
    assert spec.typical_rule == TypicalRule(0.2, 0.5)
    assert "typical_lossy" in method_label(spec)
    with pytest.raises(ConfigError, match="acceptance"):
        SpeculativeConfig("ngram", 3, acceptance="typical")
    with pytest.raises(ConfigError, match="typical_epsilon"):
        SpeculativeConfig("ngram", 3, acceptance="typical_lossy", options={"typical_epsilon": 1.5})


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0, logit_scale=3.0))


def test_greedy_decoding_stays_exact_under_it(verifier):
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in verifier.generate(prompts, greedy, speculative=None)]
    spec = SpeculativeConfig("draft_model", 4, draft_model=LLM(tiny_model(seed=3)), acceptance="typical_lossy")
    assert [o.token_ids for o in verifier.generate(prompts, greedy, speculative=spec)] == plain


def test_sampling_under_it_keeps_more_drafted_tokens_than_exact(verifier):
    """Deterministic proposals (the n-gram drafter's, like Medusa's top candidates): the
    exact rule keeps a guess x with probability p(x), typical acceptance whenever p(x) is
    typical, so it keeps more (measured here: 19% exact, 36% typical)."""
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 7, 1, 7, 7, 1, 7], [3, 9, 2, 8, 3, 9, 2]] * 3
    params = SamplingParams(temperature=1.0, max_tokens=32, seed=0)
    rates = {}
    for acceptance in ("exact", "typical_lossy"):
        spec = SpeculativeConfig("ngram", 3, ngram_min=1, acceptance=acceptance)
        outs = verifier.generate(prompts, params, speculative=spec)
        assert all(len(o.token_ids) == 32 for o in outs)
        stats = merge([o.stats for o in outs])
        rates[acceptance] = stats.accepted / stats.drafted
    assert rates["typical_lossy"] > rates["exact"] + 0.05
