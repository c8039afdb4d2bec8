"""A draft model whose head scores only part of the vocabulary (draft_vocab): the verifier
still decides over all of it, so greedy output is unchanged and sampling keeps its law."""
import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.draft_vocab import kept_ids
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8"])
def test_greedy_output_is_unchanged(dtype):
    verifier = LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=3), dtype=dtype)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    draft = LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=2), dtype=dtype)  # related: many accepts
    spec = SpeculativeConfig("draft_model", 4, draft_model=draft, options={"draft_vocab": 12})
    outs = verifier.generate(PROMPTS, greedy, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.drafted > st.accepted
    assert verifier._drafter(spec).head.ids.tolist() == list(range(12))  # no tokenizer: no special ids


def test_sampling_keeps_the_verifiers_law():
    prompt, params = [1, 2, 3, 1, 2, 3, 1, 2], dict(temperature=0.8, top_p=0.9, max_tokens=3)
    verifier = LLM(tiny_model(seed=0, vocab_size=8))
    reference = joint_distribution(verifier.model, prompt, SamplingParams(**params), n=3)
    draft = LLM(tiny_model(seed=7, vocab_size=8))
    spec = SpeculativeConfig("draft_model", 2, draft_model=draft, options={"draft_vocab": 5})
    outs = verifier.generate([prompt] * 20_000, SamplingParams(**params, seed=5), speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0 and st.bonus > 0
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3


def test_kept_ids_and_bad_values():
    assert kept_ids(6, 10, set()).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="draft_vocab"):
        SpeculativeConfig("draft_model", 4, options={"draft_vocab": 1})
