"""forerun's decoder equals transformers' on tiny random configs (float64; transformers computes RoPE angles in float32, hence 1e-6)."""
import pytest
import torch

import transformers

from forerun.kv.cache import chain_batch
from forerun.models.llama import LlamaForCausalLM, fuse_hf_state_dict
from tests.tiny import assert_full_forward_matches, hf_reference_pair

BASE = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
CASES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=6, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def _pair(case: str):
    cfg_cls, model_cls, over = CASES[case]
    hf_cfg = getattr(transformers, cfg_cls)(**{**BASE, **over})
    return hf_reference_pair(hf_cfg, getattr(transformers, model_cls), LlamaForCausalLM, fuse_hf_state_dict)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_full_forward(case):
    assert_full_forward_matches(*_pair(case))


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias"])
def test_incremental_decode_with_cache_matches(case):
    """Prefill, then chunks of 1 and 3 tokens through the cache == one full forward."""
    hf, ours = _pair(case)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = ours.new_cache(1, 64)
    pieces, start = [20, 1, 3, 1, 5], 0
    outs = []
    for n in pieces:
        chunk = ids[0, start : start + n].tolist()
        outs.append(ours(chain_batch([chunk], [start], [0], ours.device), cache).logits[0])
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-6)


def test_positions_above_original_context_with_llama3_scaling():
    hf, ours = _pair("llama3-rope")
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(chain_batch(ids.tolist(), [0], [0], ours.device), ours.new_cache(1, 300)).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
