"""Cross-tokenizer drafting on tiny models with two different BPE vocabularies."""
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.cross_tokenizer import shared_vocabulary
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.tokenizer import Tokenizer
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model


def bpe(vocab: list[str], merges: list[tuple[str, str]]) -> Tokenizer:
    return Tokenizer(Backend(models.BPE({t: i for i, t in enumerate(vocab)}, merges)), {}, {})


VERIFIER_TOK = bpe(["a", "b", "c", "d", "e", "ab", "cd"], [("a", "b"), ("c", "d")])
DRAFT_TOK = bpe(["e", "d", "c", "b", "a", "bc"], [("b", "c")])


@pytest.fixture(scope="module")
def pair():
    verifier = LLM(tiny_model(seed=0, vocab_size=7), tokenizer=VERIFIER_TOK)
    draft = LLM(tiny_model(seed=5, vocab_size=6), tokenizer=DRAFT_TOK)
    return verifier, draft


def test_shared_vocabulary_matches_by_text():
    v, d = shared_vocabulary(VERIFIER_TOK, DRAFT_TOK)
    pairs = sorted(zip(v.tolist(), d.tolist()))
    assert pairs == [(0, 4), (1, 3), (2, 2), (3, 1), (4, 0)]  # a b c d e; "ab", "cd", "bc" are not shared


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identity_via_retokenisation(pair, k):
    verifier, draft = pair
    prompts = ["abcdab", "ecdcdab", "aaaa"]
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = [o.token_ids for o in verifier.generate(prompts, greedy, speculative=None)]
    outs = verifier.generate(prompts, greedy, speculative=SpeculativeConfig("draft_model", k, draft_model=draft))
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


def test_sampling_is_exact_via_vocabulary_intersection(pair):
    verifier, draft = pair
    prompt = VERIFIER_TOK.encode("abcdabe")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=4, seed=4)
    reference = joint_distribution(verifier.model, prompt, params, n=4)
    outs = verifier.generate([prompt] * 12_000, params, speculative=SpeculativeConfig("draft_model", 2, draft_model=draft))
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0 and st.bonus > 0, st
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3


def test_same_tokenizer_with_a_padded_embedding(pair):
    """Qwen-style: one tokenizer, a draft whose logit width is padded past the vocabulary."""
    verifier, _ = pair
    padded = LLM(tiny_model(seed=5, vocab_size=9), tokenizer=VERIFIER_TOK)
    spec = SpeculativeConfig("draft_model", 3, draft_model=padded)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    plain = verifier.generate(["abcd"], greedy, speculative=None)[0].token_ids
    assert verifier.generate(["abcd"], greedy, speculative=spec)[0].token_ids == plain
    sampled = verifier.generate(["abcd"] * 50, SamplingParams(temperature=1.0, max_tokens=5, seed=1), speculative=spec)
    assert all(max(o.token_ids) < 7 for o in sampled)
