"""Gemma 3 text decoder (Gemma 3 270M, 1B, and the text part of 4B-27B).

Same contract as the llama decoder: HF parameter names, a ForwardBatch in, ModelOutput out,
the caller's mask decides which slots a query sees. What Gemma 3 adds, top-down:
  - RMSNorm scales by (1 + weight), computed in float32 at least; q and k get one per head;
  - four norms per block: around attention (input, post_attention) and around the MLP
    (pre_feedforward, post_feedforward), each output normed before it joins the residual;
  - a GeGLU MLP (GELU with the tanh approximation);
  - embeddings multiplied by sqrt(hidden_size), attention scaled by query_pre_attn_scalar**-0.5;
  - two kinds of layers: "sliding_attention" (a query at position p sees keys at positions
    p - window < pos <= p, RoPE base rope_local_base_freq) and "full_attention" (every key the
    mask allows, RoPE base rope_theta with the config's rope scaling);
  - optional tanh soft-capping of attention scores and of the final logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.errors import ModelLoadError
from forerun.kernels.backend import WIDE_ROWS, TorchBackend
from forerun.kv.cache import ForwardBatch, widened
from forerun.kv.protocol import KVStore
from forerun.models.base import DecoderBase, ModelOutput, embedding
from forerun.models.config import ModelConfig
from forerun.models.rope import apply_rope, inv_frequencies, rope_cos_sin

SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF hidden_activation -> F.gelu


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight): a zero weight is the identity scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)  # the reference normalises in float32
        h = x.to(dt)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(dt))).to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): smooth clipping to (-cap, cap); the identity when cap is None."""
    return x if cap is None else cap * torch.tanh(x / cap)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.nh, self.nkv, self.hd = layer, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.cap = cfg.attn_logit_softcapping
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, batch: ForwardBatch, cache: KVStore, backend: TorchBackend):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cache.write(self.layer, batch, k, v)
        kernel = backend.masked_kernel(q, cache) if self.cap is None else None
        if kernel is not None:
            out = self._per_query(kernel, q, mask, batch, cache, backend.prefill_sdpa)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        keys, values = cache.read(self.layer, batch)  # (B, nkv, S, hd)
        if self.cap is None:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.nkv != self.nh
            )
        else:
            out = self._capped_attention(q, keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))  # out: (B, nh, T, hd)

    def _per_query(self, kernel, q, mask, batch: ForwardBatch, cache: KVStore, prefill_sdpa: bool):
        """Attention computed so that a row's bits never depend on its batch-mates or on how
        many queries it scores: every query through the per-query kernel under its mask
        (sliding windows included), a prompt's too; with prefill_sdpa a row of WIDE_ROWS or
        more new tokens goes through SDPA on that row alone, over only the slots it can see."""
        lengths = batch.lengths  # None for a token tree: every node through the kernel
        long = [] if lengths is None or not prefill_sdpa else [b for b, n in enumerate(lengths) if n >= WIDE_ROWS]
        if not long:
            return kernel(q, self.layer, batch.row_index, mask[:, 0], self.scale)
        k_all, v_all = cache.k[self.layer], cache.v[self.layer]  # rows [rows, nkv, S, hd] (a paged cache's gathered)
        out = torch.zeros_like(q)  # (B, nh, T, hd); padded queries stay 0 (nobody reads them)
        for b in long:
            row, n = batch.rows[b], lengths[b]
            S = int(batch.slots[b, n - 1]) + 1  # a chain's last query sees slots [0, S)
            out[b : b + 1, :, :n] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :n], widened(k_all[row : row + 1, :, :S]), widened(v_all[row : row + 1, :, :S]),
                attn_mask=mask[b : b + 1, :, :n, :S], scale=self.scale, enable_gqa=self.nkv != self.nh)
        short = [b for b, n in enumerate(lengths) if n < WIDE_ROWS]
        if short:
            idx = torch.tensor(short, device=q.device)
            out[idx] = kernel(q[idx], self.layer, batch.row_index[idx], mask[idx, 0], self.scale)
        return out

    def _capped_attention(self, q, keys, values, mask):
        """Soft-capped scores need the scores themselves, so no fused kernel here."""
        group = self.nh // self.nkv
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = softcap(q @ keys.transpose(-1, -2) * self.scale, self.cap)  # (B, nh, T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
        return probs.to(q.dtype) @ values


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        activation = cfg.hidden_activation or "gelu_pytorch_tanh"
        if activation not in _GELU_APPROXIMATION:
            known = sorted(_GELU_APPROXIMATION)
            raise ModelLoadError(f"Gemma hidden_activation {activation!r} is not supported ({known})")
        self.approximate = _GELU_APPROXIMATION[activation]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.kind = cfg.layer_types[layer]
        if self.kind not in (SLIDING, FULL):
            raise ModelLoadError(f"layer {layer}: unknown Gemma 3 layer type {self.kind!r}")
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x, rope, mask, batch, cache, backend: TorchBackend):
        attended = self.self_attn(self.input_layernorm(x), rope, mask, batch, cache, backend)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def sliding_mask(batch: ForwardBatch, window: int) -> torch.Tensor:
    """batch.mask, further limited to keys at positions p - window < pos <= p for a query at p.

    Key positions come from the cache's invariant: a committed token sits at slot == position,
    and this forward's tokens at batch.slots with batch.positions (a token tree's fresh slots
    hold depth positions). Stale slots past a row's length keep slot numbers, but batch.mask
    already hides them. Example, window 3, a chain at positions 0..4: the query at 4 sees 2, 3, 4.
    """
    B, S = batch.tokens.shape[0], batch.kv_len
    key_pos = torch.arange(S, device=batch.positions.device).expand(B, S).scatter(1, batch.slots, batch.positions)
    near = key_pos[:, None, None, :] > batch.positions[:, None, :, None] - window  # [B, 1, T, S]
    return batch.mask & near


class Gemma3ForCausalLM(DecoderBase):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.layer_types is None or len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ModelLoadError("a Gemma 3 config needs one layer type per layer (ModelConfig.from_dict derives them)")
        if SLIDING in cfg.layer_types and not cfg.sliding_window:
            raise ModelLoadError("Gemma 3 sliding layers need a sliding_window")
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("global_inv_freq", None, persistent=False)  # [hd / 2] float64
        self.register_buffer("local_inv_freq", None, persistent=False)
        self.init_rope()

    def init_rope(self):
        """(Re)compute the RoPE frequencies; a model built on the meta device needs this once loaded."""
        c = self.config
        self.global_inv_freq = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling).to(self.device)
        self.local_inv_freq = inv_frequencies(c.head_dim, c.rope_local_base_freq, None).to(self.device)

    def forward(
        self, batch: ForwardBatch, cache: KVStore, logits_at: torch.Tensor | str | None = "all",
        skip: frozenset[int] = frozenset(),
    ) -> ModelOutput:
        """The DecoderBase.forward contract."""
        cache.check_fits(batch)
        x = self.model.embed_tokens(batch.tokens)  # (B, T, C)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # scale rounded to the model dtype
        ropes, masks = self._ropes(batch, x.dtype), self._masks(batch)
        for i, layer in enumerate(self.model.layers):
            if i not in skip:
                x = layer(x, ropes[layer.kind], masks[layer.kind], batch, cache, self.backend)
        hidden = self.model.norm(x)
        logits = self.head(hidden, logits_at)
        return ModelOutput(hidden, None if logits is None else softcap(logits, self.config.final_logit_softcapping))

    def hidden_to_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """DecoderBase.hidden_to_logits, with Gemma's final soft-capping as in forward."""
        return softcap(self.head(hidden, "all"), self.config.final_logit_softcapping)

    def _ropes(self, batch: ForwardBatch, dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Layer kind -> (cos, sin) [B, 1, T, hd]: the two kinds rotate with different bases."""
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return {
            FULL: rope_cos_sin(batch.positions, self.global_inv_freq.to(angle_dtype), dtype),
            SLIDING: rope_cos_sin(batch.positions, self.local_inv_freq.to(angle_dtype), dtype),
        }

    def _masks(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Layer kind -> [B, 1, T, S] bool mask."""
        window = self.config.sliding_window
        return {FULL: batch.mask, SLIDING: sliding_mask(batch, window) if window else batch.mask}
