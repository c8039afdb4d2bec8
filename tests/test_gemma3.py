"""Gemma 3: forerun's decoder vs transformers' on a tiny random config (float64), then the real
embedded Gemma 3 270M (logits, tokenizer ids, greedy identity of n-gram speculation).

The tiny config has both layer kinds and a window of 8 under a 40-token context, so the sliding
mask, the two RoPE bases and the cache all matter. transformers computes RoPE angles and the
Gemma norms in float32 even in a float64 model, hence tolerances of 1e-5 / 1e-6, not 1e-12.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from forerun.config import SamplingParams, SpeculativeConfig  # noqa: E402
from forerun.kv_cache import chain_batch, tree_batch  # noqa: E402
from forerun.models.config import ModelConfig  # noqa: E402
from forerun.models.gemma3 import Gemma3ForCausalLM  # noqa: E402
from forerun.models.loader import finish_model  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16)
CASES = {
    "plain": {},
    # (attn_logit_softcapping is not here: transformers' Gemma 3 ignores it; see the test below)
    "scaled-softcapped": dict(rope_scaling=dict(rope_type="linear", factor=4.0), final_logit_softcapping=3.0,
                              tie_word_embeddings=False, num_key_value_heads=2),
}


def _pair(case: str):
    hf_cfg = transformers.Gemma3TextConfig(**{**TINY, **CASES[case]})
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(hf_cfg).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    ours = Gemma3ForCausalLM(ModelConfig.from_dict(hf_cfg.to_dict()))
    ours.load_state_dict(hf.state_dict())
    return hf, finish_model(ours.double(), "float64", "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_full_forward(case):
    hf, ours = _pair(case)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(chain_batch(ids.tolist(), [0, 0], [0, 1], ours.device), ours.new_cache(2, 40)).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_decode_with_cache_matches(case):
    """Prefill 20, then chunks of 1, 3, 1 and 5 tokens through the cache == one full forward."""
    hf, ours = _pair(case)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache, start, outs = ours.new_cache(1, 64), 0, []
    for n in [20, 1, 3, 1, 5]:
        chunk = ids[0, start : start + n].tolist()
        outs.append(ours(chain_batch([chunk], [start], [0], ours.device), cache).logits[0])
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-6)


def test_token_tree_branches_match_their_chains():
    """A tree's nodes sit at fresh slots with depth positions; each branch must score as if it
    were fed as a plain chain, window included (the prefix is longer than the window)."""
    _, ours = _pair("plain")
    prefix = torch.randint(0, 64, (25,), generator=torch.Generator().manual_seed(3)).tolist()
    # node 0 = pending token; branches 0 -> 1 -> 3 and 0 -> 2 -> 4
    nodes, parents = [7, 11, 13, 17, 19], [-1, 0, 0, 1, 2]
    cache = ours.new_cache(1, 64)
    ours(chain_batch([prefix], [0], [0], ours.device), cache, logits_at=None)
    tree = ours(tree_batch([nodes], [parents], [len(prefix)], [0], ours.device), cache).logits[0]
    for branch in ([0, 1, 3], [0, 2, 4]):
        chain_cache = ours.new_cache(1, 64)
        tokens = prefix + [nodes[i] for i in branch]
        want = ours(chain_batch([tokens], [0], [0], ours.device), chain_cache).logits[0, len(prefix):]
        torch.testing.assert_close(tree[branch], want, rtol=1e-9, atol=1e-9)


def test_attention_softcap_path():
    """The soft-capped (unfused) attention equals SDPA when the cap is far above every score,
    and caps the scores otherwise. transformers' Gemma 3 never applies attn_logit_softcapping
    (no Gemma 3 checkpoint sets it), so this is checked against SDPA instead of against it."""
    _, ours = _pair("scaled-softcapped")
    attn = ours.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 12, 16, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=True)
    attn.cap = 1e9
    torch.testing.assert_close(attn._capped_attention(q, k, v, mask), fused, rtol=1e-9, atol=1e-9)
    attn.cap = 0.1
    assert not torch.allclose(attn._capped_attention(q, k, v, mask), fused, atol=1e-3)
