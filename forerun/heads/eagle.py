"""The EAGLE draft head (Li et al. 2024): one decoder layer that runs autoregressively over
the verifier's hidden states, one step ahead of them.

Input at position j is the pair (f_j, x_{j+1}): the verifier's hidden state at token x_j
(after its final norm, what its LM head reads) and the embedding of the token that
followed. fc maps [f_j; emb(x_{j+1})] (2H) to H, a llama decoder layer (forerun's own,
with its own one-layer KV cache, causal over positions) mixes in the earlier pairs, and a
final RMSNorm gives f^_{j+1}, the head's guess of the verifier's next hidden state; the
verifier's LM head turns it into a distribution over x_{j+2}. Drafting feeds the guess back:
(f^_{j+1}, drafted x_{j+2}) is the next pair.

The output norm is forerun's choice: targets are post-norm hidden states, and the norm
(initialised from the verifier's final norm when training) keeps guesses on their scale.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from forerun.kv.cache import ForwardBatch, KVCache
from forerun.models.config import ModelConfig
from forerun.kernels.backend import TorchBackend
from forerun.models.llama import DecoderLayer, RMSNorm, attention_bias
from forerun.models.rope import inv_frequencies, rope_cos_sin


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None

    @classmethod
    def for_verifier(cls, c: ModelConfig, intermediate_size: int | None = None) -> "EagleConfig":
        """The verifier's layer shape (one layer of it); intermediate_size narrows its MLP."""
        return cls(c.hidden_size, intermediate_size or c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.rms_norm_eps, c.rope_theta, c.rope_scaling)

    def layer_config(self) -> ModelConfig:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ModelConfig(vocab_size=1, num_hidden_layers=1, **fields)


class EagleHead(nn.Module):
    kind = "eagle"
    # Its one layer runs op by op in torch (a head's own cache and shapes; no compiled paths).
    backend = TorchBackend()

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H)
        self.layer = DecoderLayer(cfg.layer_config(), 0)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        c, w = self.config, self.norm.weight  # (fc may be an int8 linear: no .weight)
        return KVCache(1, rows, c.num_key_value_heads, capacity, c.head_dim, w.dtype, w.device)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """features, embeds [B, T, H] (pair j = (f_j, emb(x_{j+1})) at batch.positions j)
        -> [B, T, H] guesses f^_{j+1}. Writes the pairs' K/V into `cache` at batch.slots."""
        cache.check_fits(batch)
        x = self.fc(torch.cat([features, embeds], dim=-1))
        rope_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq.to(rope_dtype), x.dtype)
        x = self.layer(x, cos, sin, batch, cache, attention_bias(batch, x.dtype), self.backend)
        return self.norm(x)


class SplitInputLinear(nn.Module):
    """fc as two linears, one over the feature half of [f; emb] and one over the embedding
    half, summed: the same function, but an int8 copy (quantize_int8_ reaches both) then
    scales each half's activations by its own per-token range. One range over the whole
    row is set by the features (Qwen2.5-1.5B: |f| up to ~126) and rounds the embeddings
    (|e| ~0.02) to zero, so the int8 head lost which token it was given: served second-position
    acceptance fell from 18 to 6 of 35-38 first-position hits on two Qwen prompts."""

    def __init__(self, fc: nn.Linear, split: int):
        super().__init__()
        self.split = split
        w, b = fc.weight.detach(), fc.bias
        self.features = nn.Linear(split, fc.out_features, bias=b is not None, device=w.device, dtype=w.dtype)
        self.embeds = nn.Linear(w.shape[1] - split, fc.out_features, bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.features.weight.copy_(w[:, :split])
            self.embeds.weight.copy_(w[:, split:])
            if b is not None:
                self.features.bias.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x[..., : self.split]) + self.embeds(x[..., self.split :])
