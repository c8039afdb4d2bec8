"""Which verifier a head was trained on: a short hash that every forerun precision of the
same weights shares.

A head reads the verifier's hidden states and shares its LM head, so a head trained on one
model is noise on another. The hash covers the architecture numbers, 256 evenly spaced rows
of the token embedding and the final norm's weight, each rounded to bfloat16 through
float32. forerun never quantises those two tensors (int8 / int4 replace linears only), so
float32, bfloat16, int8 and int4 loads of one checkpoint agree, while another model (or a
fine-tune that touched its embeddings or final norm) does not. A fine-tune that changed
neither is not told apart; exactness never depends on this (verification is lossless),
only acceptance does.
"""
from __future__ import annotations

import hashlib
import json

import torch


def verifier_fingerprint(model) -> str:
    """16 hex digits identifying a forerun decoder's weights (see the module docstring)."""
    c = model.config
    arch = [c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim]
    h = hashlib.sha256(json.dumps(arch).encode())
    emb = model.model.embed_tokens.weight
    rows = torch.linspace(0, emb.shape[0] - 1, 256).round().long().unique().to(emb.device)
    for t in (emb[rows], model.model.norm.weight):
        h.update(_bf16_bytes(t))
    return h.hexdigest()[:16]


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.detach().float().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
