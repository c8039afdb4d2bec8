"""Token trees: the tree mask, the walk, greedy identity and exactness of both sibling rules."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.ngram import find_continuations, trie
from forerun.kv.cache import chain_batch, tree_batch
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.sampling import make_generator
from forerun.verify import tree_verify
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model

CPU = torch.device("cpu")


def test_chain_as_tree_gives_chain_logits():
    m = tiny_model()
    prefix, new = [1, 2, 3, 4], [5, 6, 7]
    a_cache, b_cache = m.new_cache(1, 16), m.new_cache(1, 16)
    for c in (a_cache, b_cache):
        m(chain_batch([prefix], [0], [0], CPU), c, logits_at=None)
    a = m(chain_batch([new], [4], [0], CPU), a_cache).logits
    b = m(tree_batch([new], [[-1, 0, 1]], [4], [0], CPU), b_cache).logits
    torch.testing.assert_close(a, b)


def test_tree_branch_logits_equal_its_own_chain():
    """Node 3 (child of node 1's sibling) must see only its ancestors: compare with a chain."""
    m = tiny_model()
    prefix = [1, 2, 3, 4]
    c1, c2 = m.new_cache(1, 16), m.new_cache(1, 16)
    for c in (c1, c2):
        m(chain_batch([prefix], [0], [0], CPU), c, logits_at=None)
    # tree: root 9 -> {5 -> 6, 7 -> 8}
    tree = m(tree_batch([[9, 5, 6, 7, 8]], [[-1, 0, 1, 0, 3]], [4], [0], CPU), c1).logits[0]
    chain = m(chain_batch([[9, 7, 8]], [4], [0], CPU), c2).logits[0]
    torch.testing.assert_close(tree[[0, 3, 4]], chain)


def test_trie_and_multiple_matches():
    conts = find_continuations([1, 2, 3, 1, 2, 4, 1, 2], 2, 1, 3, branches=4)
    assert conts[0] == [4, 1, 2] and [3, 1, 2] in conts
    tokens, parents = trie([[4, 1], [4, 2], [3]])
    assert tokens == [4, 1, 2, 3] and parents == [-1, 0, 0, -1]


def _onehot(rows, v=5):
    return torch.nn.functional.one_hot(torch.tensor(rows), v).double()


def test_greedy_walk_picks_the_matching_branch():
    # tree: a=1 (node 0) -> b=2 (node 1); sibling c=3 (node 2) -> d=4 (node 3)
    tokens, parents = [1, 2, 3, 4], [-1, 0, -1, 2]
    logits = _onehot([3, 0, 0, 4, 1])  # root argmax 3 -> node 2; node 2 argmax 4 -> node 3; node 3 argmax 1
    r = tree_verify(tokens, parents, None, logits, True, None)
    assert (r.path, r.next_token, r.at_leaf) == ([2, 3], 1, True)
    r = tree_verify(tokens, parents, None, _onehot([0, 0, 0, 0, 0]), True, None)
    assert (r.path, r.next_token, r.at_leaf) == ([], 0, False)


def test_deterministic_siblings_second_candidate_accepted_exactly():
    """p = [0.1, 0.6, 0.3]: candidates 1 then 2. P(accept 1) = 0.6; P(accept 2) = 0.4 * 0.75."""
    p = torch.tensor([[0.1, 0.6, 0.3], [1, 0, 0], [1, 0, 0]], dtype=torch.float64)
    counts = {0: 0, 1: 0, 2: 0}
    gen = make_generator(0, CPU)
    for _ in range(20000):
        r = tree_verify([1, 2], [-1, -1], None, p, False, gen)
        counts[[1, 2][r.path[0]] if r.path else r.next_token] += 1
    freq = [counts[t] / 20000 for t in range(3)]
    assert all(abs(f - e) < 0.015 for f, e in zip(freq, [0.1, 0.6, 0.3]))


VOCAB8 = dict(vocab_size=8)
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
N = 12_000


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0, **VOCAB8))


@pytest.mark.parametrize("k", [2, 4])
def test_tree_greedy_identity(verifier, k):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    prompts = [PROMPT, [5, 6, 5, 6, 7]]
    plain = [o.token_ids for o in verifier.generate(prompts, greedy, speculative=None)]
    draft = LLM(tiny_model(seed=3, **VOCAB8))
    for spec in (SpeculativeConfig("ngram", k, ngram_branches=3),
                 SpeculativeConfig("draft_model", k, draft_model=draft, tree_width=3)):
        outs = verifier.generate(prompts, greedy, speculative=spec)
        assert [o.token_ids for o in outs] == plain
        assert merge([o.stats for o in outs]).accepted > 0


@pytest.mark.parametrize("rule", ["deterministic (ngram trie)", "independent (draft_model fan-out)"])
def test_tree_sampling_is_exact(verifier, rule):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=11)
    reference = joint_distribution(verifier.model, PROMPT, params, n=4)
    if rule.startswith("deterministic"):
        spec = SpeculativeConfig("ngram", 2, ngram_branches=3)
    else:
        spec = SpeculativeConfig("draft_model", 2, draft_model=LLM(tiny_model(seed=7, **VOCAB8)), tree_width=3)
    outs = verifier.generate([PROMPT] * N, params, speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0 and st.bonus > 0, st
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3
