"""The qwen2 shape (q/k/v biases, untied or tied head) through the whole engine: greedy
speculative output equals plain output at every precision, with a qwen2 draft model (the
Qwen2.5-Coder 1.5B / 0.5B pairing in miniature) and with prompt lookup."""
import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.metrics import merge
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4] * 70]
QWEN2 = dict(model_type="qwen2", attention_bias=True, hidden_size=64, intermediate_size=128)


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8"])
def test_qwen2_speculative_equals_plain(dtype):
    verifier = LLM(tiny_model(seed=1, dtype=dtype, num_hidden_layers=3, **QWEN2), dtype=dtype)
    draft = LLM(tiny_model(seed=2, dtype=dtype, tie_word_embeddings=True, **QWEN2), dtype=dtype)
    assert verifier.model.model.layers[0].self_attn.qkv_proj.bias is not None
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    for spec in (SpeculativeConfig("draft_model", 5, draft_model=draft), SpeculativeConfig("ngram", 4, ngram_max=3)):
        outs = verifier.generate(PROMPTS, greedy, speculative=spec)
        assert [o.token_ids for o in outs] == plain, spec.method
        assert merge([o.stats for o in outs]).drafted > 0
