"""Suffix decoding: its candidate trees, its store of earlier outputs by tenant, and its output,
which equals plain decoding's (greedy) and keeps the verifier's law (sampling), alone and as
a hybrid with a draft model."""
import doctest

import numpy as np
import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters import suffix_tree
from forerun.drafters.base import DraftRequest
from forerun.drafters.suffix import SuffixDrafter, SuffixStore
from forerun.drafters.suffix_tree import SuffixRule, best_candidate, grow_tree
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.test_greedy_identity import GREEDY, PROMPTS, plain, verifier  # noqa: F401 (fixtures)
from tests.test_statistical import ALPHA, N, PARAMS, PROMPT
from tests.tiny import tiny_model



def test_doctests():
    assert doctest.testmod(suffix_tree).failed == 0


def _brute_counts(hay: list[int], tail: list[int], depth: int) -> dict[tuple, int]:
    """What a suffix tree stores for `tail`: how many of its occurrences each continuation
    (up to `depth` tokens, cut at -1) follows; a scan, no numpy."""
    n, counts = len(tail), {}
    for e in range(n - 1, len(hay)):
        if hay[e - n + 1 : e + 1] == tail:
            cont = []
            for t in hay[e + 1 : e + 1 + depth]:
                if t == -1:
                    break
                cont.append(t)
            for d in range(1, len(cont) + 1):
                counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
    return counts


def test_the_tree_is_the_best_over_match_lengths_of_the_most_frequent_continuations():
    rng = np.random.default_rng(0)
    rule = SuffixRule(max_match=64, factor=1.0, min_prob=0.0)
    for _ in range(300):
        hay = rng.integers(0, 3, size=int(rng.integers(5, 60))).tolist()
        pattern = rng.integers(0, 3, size=int(rng.integers(1, 8))).tolist()
        budget = int(rng.integers(1, 5))
        best = 0.0
        for n in range(1, len(pattern) + 1):
            counts = _brute_counts(hay, pattern[-n:], depth=min(budget, n))
            roots = sum(c for p, c in counts.items() if len(p) == 1)
            if roots:  # the m most frequent continuation prefixes (always closed under parents)
                best = max(best, sum(sorted(counts.values())[::-1][: min(budget, n)]) / roots)
        cand = best_candidate(np.array(hay), np.array(pattern), budget, rule)
        assert cand.score == pytest.approx(best), (hay, pattern, budget)
        if cand.tokens:
            counts = _brute_counts(hay, pattern[-cand.match_len :], depth=len(cand.tokens))
            paths = []
            for tok, par in zip(cand.tokens, cand.parents):
                paths.append((paths[par] if par >= 0 else ()) + (tok,))
            assert all(p in counts for p in paths) and len(set(paths)) == len(paths), (hay, pattern, paths)


def test_grow_tree_keeps_probability_order_and_the_floor():
    conts = [[1, 2, 3]] * 6 + [[1, 4]] * 3 + [[5]]
    tokens, parents, score = grow_tree(conts, 10, 0.25)
    assert tokens == [1, 2, 3, 4] and parents == [-1, 0, 1, 0]
    assert score == pytest.approx(0.9 + 0.6 + 0.6 + 0.3)  # [5] (0.1) is under the floor
    assert grow_tree(conts, 1, 0.0)[0] == [1]
    assert grow_tree([[]], 5, 0.0) == ([], [], 0.0)


def test_the_draft_grows_with_the_match_length():
    text = [7, 8, 9, 1, 2, 3, 4, 5, 6, 10, 11, 12]
    rule = SuffixRule(factor=1.0, min_prob=0.0)
    short = best_candidate(np.array(text), np.array([0, 0, 9, 1]), 8, rule)  # "9 1" matched: 2 nodes
    long = best_candidate(np.array(text), np.array([7, 8, 9, 1]), 8, rule)  # 4 tokens matched: 4 nodes
    assert short.tokens == [2, 3] and long.tokens == [2, 3, 4, 5]


def test_store_is_bounded_oldest_out_and_kept_apart_by_tenant():
    store = SuffixStore(max_requests=2)
    store.add(b"a", [1, 2, 3])
    store.add(b"b", [4, 5])
    store.add(b"a", [6])
    assert len(store) == 2
    assert store.hay(b"a").tolist() == [6, -1]  # [1, 2, 3] was the oldest
    assert store.hay(b"b").tolist() == [4, 5, -1]
    assert store.hay(b"c").tolist() == []
    assert store.reset() == 2 and store.hay(b"b").tolist() == []


def test_an_earlier_output_drafts_for_its_own_tenant_only():
    d = SuffixDrafter(SuffixRule(min_prob=0.0), max_requests=8)
    earlier = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    d.retire(DraftRequest(0, [1, 2] + earlier, 0, prompt_len=2, tenant=b"alice"))
    ask = [9, 9, 40, 41, 42, 43]
    mine = d.propose([DraftRequest(0, ask, 4, prompt_len=2, tenant=b"alice")], GREEDY, None)[0]
    theirs = d.propose([DraftRequest(0, ask, 4, prompt_len=2, tenant=b"bob")], GREEDY, None)[0]
    assert mine.tokens == [44, 45, 46, 47]  # a same-tenant hit
    assert theirs.tokens == []  # no cross-tenant hit
    assert b"alice" in d.store._hay and 1 == len(d.store)  # (the prompt [1, 2] was not stored)


def test_bad_options_are_refused():
    llm = LLM(tiny_model(seed=0))
    for opts in ({"suffix_cache_requests": -1}, {"suffix_min_prob": 2.0}, {"suffix_max_match": 0},
                 {"suffix_min_score": float("nan")}, {"suffix_min_score": -1}, {"suffix_min_score": "1"}):
        with pytest.raises(ConfigError, match="suffix"):
            llm.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("suffix", 4, options=opts))


# -- through LLM.generate (greedy_identity's verifier, prompts and plain outputs) ---------------------


@pytest.mark.parametrize("k", [2, 5, 12])
def test_suffix_equals_plain_and_learns_across_calls(verifier, plain, k):
    spec = SpeculativeConfig("suffix", k, options={"suffix_min_prob": 0.0})
    first = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    again = verifier.generate(PROMPTS, GREEDY, speculative=spec)  # the store now holds the first call's outputs
    assert [o.token_ids for o in first] == plain and [o.token_ids for o in again] == plain
    st1, st2 = merge([o.stats for o in first]), merge([o.stats for o in again])
    assert st2.accepted > st1.accepted and st2.accepted >= sum(map(len, plain)) // 2, (st1, st2)


def test_trees_are_drafted_and_verified(verifier, plain):
    """Two earlier outputs that share a start and then part: the next draft is a tree."""
    spec = SpeculativeConfig("suffix", 6, options={"suffix_min_prob": 0.0})
    d = verifier.drafter_for(spec)
    d.store.add(b"", plain[0][:6] + [11, 12, 13])
    d.store.add(b"", plain[0][:6] + [21, 22, 23])
    draft = d.propose([DraftRequest(0, PROMPTS[0] + plain[0][:4], 6)], GREEDY, None)[0]
    assert draft.is_tree and {11, 21} <= set(draft.tokens)  # the two earlier endings, siblings
    assert [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=spec)] == plain


def test_hybrid_uses_both_drafters_and_equals_plain(verifier, plain):
    spec = SpeculativeConfig("suffix", 4, draft_model=LLM(tiny_model(seed=3)), options={"suffix_min_score": 1.5})
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)  # now with earlier outputs to match
    d = verifier.drafter_for(spec)
    assert [o.token_ids for o in outs] == plain
    assert d.suffix_drafts > 0 and d.fallback_drafts > 0, (d.suffix_drafts, d.fallback_drafts)


# -- sampling keeps the verifier's law (test_statistical's prompt, parameters and bar) ---------------
@pytest.fixture(scope="module")
def small():
    return LLM(tiny_model(seed=0, vocab_size=8, logit_scale=1.0))


@pytest.fixture(scope="module")
def reference(small):
    return joint_distribution(small.model, PROMPT, SamplingParams(**PARAMS), n=PARAMS["max_tokens"])


def _seeded_store(drafter):
    """Earlier outputs that continue the prompt's tail `1 2` and any first token t in two ways
    (so the step after the first token drafts a tree of siblings t+1 / t+3), plus chains, then
    no more: every row of the run drafts from the same store."""
    texts = [[1, 2, t, (t + 1) % 8, (t + 2) % 8] for t in range(8)]
    texts += [[1, 2, t, (t + 3) % 8, (t + 5) % 8] for t in range(8)]
    texts += [[3, 1, 2], [5, 6, 7], [3, 3, 3]]
    drafter.store.max_requests = len(texts)
    for cont in texts:
        drafter.store.add(b"", cont)
    drafter.store.max_requests = 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_suffix_sampling_is_exact(small, reference, hybrid):
    draft = LLM(tiny_model(seed=7, vocab_size=8, logit_scale=1.0)) if hybrid else None
    spec = SpeculativeConfig("suffix", 3, draft_model=draft,
                             options={"suffix_min_prob": 0.0, "suffix_cache_requests": 0, "suffix_min_score": 1.0})
    drafter = small.drafter_for(spec)
    _seeded_store(drafter)
    assert drafter.candidate(DraftRequest(0, PROMPT + [0], 2)).parents == [-1, -1]  # siblings 1 / 3 after a first 0
    outs = small.generate([PROMPT] * N, SamplingParams(**PARAMS, seed=5), speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0, st
    if hybrid:
        assert drafter.suffix_drafts > 0 and drafter.fallback_drafts > 0
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > ALPHA
