"""Tiny random-weight decoders built from a config inside the tests (no files, no network)."""
from __future__ import annotations

import torch

import dataclasses

from forerun.kv.cache import chain_batch
from forerun.models.config import ModelConfig
from forerun.models.llama import LlamaForCausalLM
from forerun.models.loader import finish_model


def tiny_config(**over) -> ModelConfig:
    base = dict(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    base.update(over)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype: str = "float64", logit_scale: float = 1.0, **over) -> LlamaForCausalLM:
    """Random weights (std 0.2 so outputs depend on context); logit_scale sharpens p."""
    cfg = tiny_config(**over)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(logit_scale)
    model = model.to({"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32))
    return finish_model(model, dtype, "cpu")


def truncated_copy(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The first `num_layers` layers + final norm + head, sharing the verifier's weights."""
    cfg = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    with torch.device("meta"):
        small = LlamaForCausalLM(cfg)
    keep = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    small.load_state_dict(keep, strict=False, assign=True)
    return finish_model(small, "float32" if model.dtype == torch.float32 else "float64", model.device)


def hf_reference_pair(hf_cfg, hf_model_cls, our_cls, convert=lambda state: state):
    """A transformers model with random float64 weights (std 0.1, seed 0) and forerun's
    `our_cls` loaded with the same weights (through `convert`, e.g. fuse_hf_state_dict)."""
    torch.manual_seed(0)
    hf = hf_model_cls(hf_cfg).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    ours = our_cls(ModelConfig.from_dict(hf_cfg.to_dict()))
    ours.load_state_dict(convert(hf.state_dict()))
    return hf, finish_model(ours.double(), "float64", "cpu")


def assert_full_forward_matches(hf, ours):
    """Two sequences of 40 random ids through both models in one forward: equal logits."""
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(chain_batch(ids.tolist(), [0, 0], [0, 1], ours.device), ours.new_cache(2, 40)).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
