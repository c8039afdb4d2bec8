"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU.

Reads top-down: norm -> attention -> MLP -> block -> model. Weight names follow
Hugging Face so a HF state dict loads as is. The model never decides *which* tokens
to run: the caller's ForwardBatch gives tokens, RoPE positions, cache slots and the
attention mask (chains, padded batches and token trees alike).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.kernels.backend import TorchBackend
from forerun.kv.cache import ForwardBatch
from forerun.kv.protocol import KVStore
from forerun.models.base import DecoderBase, ModelOutput, embedding
from forerun.models.config import ModelConfig
from forerun.models.rope import RopeTable, apply_rope, inv_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype in (torch.float32, torch.float64):  # one fused kernel, same math
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: normalise in float32 (bfloat16 variance is too coarse), like the reference.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.nh, self.nkv, self.hd = layer, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q, k and v in one GEMM (HF's q_proj/k_proj/v_proj are concatenated at load time).
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    # q, k and v come straight from qkv_proj and only RoPE touches q and k, which is what the
    # kernels' fused attention (rope_write_attend) computes. An architecture that normalises
    # q and k (Qwen3) sets this False, and its attention keeps the op-by-op path.
    plain_qkv = True

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: KVStore, bias: torch.Tensor | None, backend: TorchBackend):
        """bias: [B, 1, T, S] additive mask (0 or -inf) built from batch.mask, or None when
        batch.attention says the rule is plain (every slot, or causal from slot 0)."""
        B, T, _ = x.shape
        fused = backend.attention(self, x, cos, sin, batch, cache)  # one compiled call where it takes the forward
        if fused is not None:
            return self.o_proj(fused)
        qkv = self.qkv_proj(x).view(B, T, self.nh + 2 * self.nkv, self.hd).transpose(1, 2)
        qk = apply_rope(qkv[:, : self.nh + self.nkv], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, : self.nh], qk[:, self.nh :], qkv[:, self.nh + self.nkv :]  # (B, nh | nkv, T, hd)
        cache.write(self.layer, batch, k, v)
        out = backend.attend(self, q, batch, cache, bias)  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


def attention_bias(batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, 1, T, S] additive mask (0 / -inf) from batch.mask, or None when batch.attention
    names a rule attention applies by itself ("all", "causal")."""
    if batch.attention != "mask":
        return None
    return torch.zeros(batch.mask.shape, dtype=dtype, device=batch.mask.device).masked_fill_(~batch.mask, float("-inf"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # gate and up in one GEMM (HF's gate_proj/up_proj concatenated at load time).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, backend: TorchBackend):
        return self.down_proj(backend.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, batch, cache, bias, backend: TorchBackend):
        fused = backend.layer(self, x, cos, sin, batch, cache)  # the same ops from C++: the same bits, one call
        if fused is not None:
            return fused
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, bias, backend)
        return x + self.mlp(self.post_attention_layernorm(x), backend)

    def one_call_form(self) -> bool:
        """Whether layer_rows.cpp's one-call layer computes this layer: both norms folded into
        the linears they feed (Identity here) and an attention the fused kernel computes."""
        return (self.self_attn.plain_qkv and isinstance(self.input_layernorm, nn.Identity)
                and isinstance(self.post_attention_layernorm, nn.Identity))

    def bound_linears(self):
        """qkv, o, gate_up and down's bound kernels (KernelLinear), or None where one has none."""
        a, m = self.self_attn, self.mlp
        bound = tuple(getattr(q, "kernel_linear", None) for q in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
        return None if None in bound else bound


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# This decoder's linears that stack several of HF's: q/k/v in one GEMM, gate/up in another.
FUSED_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> this module's: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""
    out = dict(state)
    for key in state:
        for target, parts in FUSED_LINEARS.items():
            for suffix in ("weight", "bias"):
                if key.endswith(f"{parts[0]}.{suffix}"):
                    prefix = key[: -len(f"{parts[0]}.{suffix}")]
                    names = [f"{prefix}{p}.{suffix}" for p in parts]
                    out[f"{prefix}{target}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    return out


class LlamaForCausalLM(DecoderBase):
    fused_linears = FUSED_LINEARS  # (gguf/place.py stacks a GGUF file's parts the same way)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_table = None  # RoPE's cos / sin by position, built on the first forward (see _rope)
        self.register_buffer("inv_freq", inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    def fold_norms(self) -> None:
        """For the int8, int4 and gguf models: each layer's two RMSNorms run inside the kernel of
        the one linear they feed (q/k/v, gate/up), and the layer's own norm call goes away.
        Then a layer can run as one compiled call (CpuKernels.layer)."""
        for layer in self.model.layers:
            for norm_name, linear in (("input_layernorm", layer.self_attn.qkv_proj), ("post_attention_layernorm", layer.mlp.gate_up_proj)):
                absorb = getattr(linear, "absorb_norm", None)  # Int8Linear, Int4Linear, GGUFLinear
                if absorb is not None and absorb(getattr(layer, norm_name)):
                    setattr(layer, norm_name, nn.Identity())

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] of the positions (rope_cos_sin's values, by lookup)."""
        table = self.rope_table
        if table is None or table.source is not self.inv_freq or table.dtype != dtype:  # first call, moved, reloaded
            rope_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            table = self.rope_table = RopeTable(self.inv_freq.to(rope_dtype), dtype, source=self.inv_freq)
        return table(positions)

    def forward(
        self, batch: ForwardBatch, cache: KVStore, logits_at: torch.Tensor | str | None = "all",
        skip: frozenset[int] = frozenset(),
    ) -> ModelOutput:
        """The DecoderBase.forward contract."""
        cache.check_fits(batch)
        x = self.model.embed_tokens(batch.tokens)  # (B, T, C)
        cos, sin = self._rope(batch.positions, x.dtype)
        stacked = None if skip else self.backend.layer_stack(self, x, cos, sin, batch, cache)
        if stacked is not None:
            x = stacked
        else:
            # SDPA would turn a bool mask into an additive one in every layer: do it once here,
            # and not at all when SDPA's own rule is the same (one decode token, a fresh prefill).
            bias = attention_bias(batch, x.dtype)
            for i, layer in enumerate(self.model.layers):
                if i not in skip:
                    x = layer(x, cos, sin, batch, cache, bias, self.backend)
        hidden = self.backend.final_norm(self.model.norm, x)
        return ModelOutput(hidden, self.head(hidden, logits_at))
