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

from forerun.kv_cache import ForwardBatch, KVCache
from forerun.models.base import DecoderBase, ModelOutput
from forerun.models.config import ModelConfig
from forerun.models.quant import WIDE_ROWS
from forerun.models.rope import RopeTable, apply_rope, inv_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # the compiled rms_norm_rows (the kernel linears' own norm), set by use_int8_kernels

    def forward(self, x):
        if self.kernel is not None and x.dtype == torch.float32:
            return self.kernel(x, self.weight, self.eps)
        if x.dtype in (torch.float32, torch.float64):  # one fused kernel, same math
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: normalise in float32 (bfloat16 variance is too coarse), like the reference.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query per row that sees every key: q [B, nh, 1, hd], keys/values [B, nkv, S, hd].

    Two batched matmuls with the query heads grouped under their shared K/V head. On the
    CPU this costs about 0.6x of SDPA's flash kernel at S = 800 (that kernel tiles for
    many queries), which matters: one decode step runs it once per layer.
    """
    B, nh, _, hd = q.shape
    nkv = keys.shape[1]
    scores = torch.matmul(q.view(B, nkv, nh // nkv, hd), keys.transpose(-1, -2)).mul_(hd**-0.5)  # [B, nkv, g, S]
    return torch.matmul(torch.softmax(scores, dim=-1), values).view(B, nh, 1, hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.nh, self.nkv, self.hd = layer, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q, k and v in one GEMM (HF's q_proj/k_proj/v_proj are concatenated at load time).
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.prefix_attention = None  # the compiled per-query kernel, set by use_int8_kernels
        self.fused_layer = None  # the same kernel with RoPE and the cache write folded in (rope_write_attend)
        self.masked_attention = None  # the same kernel under an explicit mask: token trees (attend_masked)

    @staticmethod
    def _fusable(x, batch: ForwardBatch, cache) -> bool:
        """A chain of short rows over forerun's own row cache (a paged cache gathers its
        blocks, so it keeps the op-by-op path), in float32."""
        return (batch.starts is not None and type(cache) is KVCache and x.dtype == torch.float32
                and max(batch.lengths) < WIDE_ROWS)

    @staticmethod
    def _one_call(x, batch: ForwardBatch, cache) -> bool:
        """A forward the one-call layer (and the layer stack) takes: a fusable chain whose
        linears run their few-token kernel (fewer than WIDE_ROWS tokens in all)."""
        return x.shape[0] * x.shape[1] < WIDE_ROWS and Attention._fusable(x, batch, cache)

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: KVCache, bias: torch.Tensor):
        """bias: [B, 1, T, S] additive mask (0 or -inf) built from batch.mask, or None when
        batch.attention says the rule is plain (every slot, or causal from slot 0)."""
        B, T, _ = x.shape
        if self.fused_layer is not None and self._fusable(x, batch, cache):  # one compiled call (attention_rows.cpp)
            out = self.fused_layer(self.qkv_proj(x), cos, sin, cache.k[self.layer], cache.v[self.layer],
                                   batch.row_index, batch.slots, self.nh, self.nkv, self.hd**-0.5)
            return self.o_proj(out)
        qkv = self.qkv_proj(x).view(B, T, self.nh + 2 * self.nkv, self.hd).transpose(1, 2)
        qk = apply_rope(qkv[:, : self.nh + self.nkv], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, : self.nh], qk[:, self.nh :], qkv[:, self.nh + self.nkv :]  # (B, nh | nkv, T, hd)
        cache.write(self.layer, batch, k, v)
        if self.prefix_attention is not None and batch.starts is not None:  # a chain, int8 kernels
            out = self._chain_attention(q, batch, cache, bias)
        elif self.masked_attention is not None and batch.attention == "mask" and T < WIDE_ROWS and q.dtype == torch.float32:
            # a token tree: per query too, so a node on the accepted path gets its chain's bits
            out = self.masked_attention(q, cache.k[self.layer], cache.v[self.layer], batch.row_index, batch.mask[:, 0],
                                        self.hd**-0.5)
        elif T == 1 and batch.attention == "all" and q.dtype in (torch.float32, torch.float64):
            out = one_query_attention(q, *cache.read(self.layer, batch))  # plain decoding: the most frequent forward
        else:
            out = self._sdpa(q, batch, cache, bias)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def _sdpa(self, q, batch: ForwardBatch, cache: KVCache, bias):
        keys, values = cache.read(self.layer, batch)  # (B, nkv, S, hd)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=bias, is_causal=batch.attention == "causal", enable_gqa=self.nkv != self.nh
        )  # (B, nh, T, hd)

    def _chain_attention(self, q, batch: ForwardBatch, cache: KVCache, bias):
        """Chain attention of the int8 and float32 CPU models (the compiled kernels), computed
        so that a row's bits never depend on its batch-mates: a row with fewer than WIDE_ROWS
        new tokens goes through the per-query kernel; a longer one (a prompt) through SDPA's
        flash kernel on that row alone, with exactly the shapes it would have if it were the
        only row."""
        scale = self.hd**-0.5
        k_all, v_all = cache.k[self.layer], cache.v[self.layer]
        long = [b for b, n in enumerate(batch.lengths) if n >= WIDE_ROWS]
        if not long:
            return self.prefix_attention(q, k_all, v_all, batch.row_index, batch.slots + 1, scale)
        out = torch.zeros_like(q)  # (B, nh, T, hd); padded queries stay 0 (nobody reads them)
        for b in long:
            out[b : b + 1, :, : batch.lengths[b]] = self._row_sdpa(q[b : b + 1], k_all, v_all, batch, b)
        short = [b for b, n in enumerate(batch.lengths) if n < WIDE_ROWS]
        if short:
            idx = torch.tensor(short, device=q.device)
            out[idx] = self.prefix_attention(q[idx], k_all, v_all, batch.row_index[idx], batch.slots[idx] + 1, scale)
        return out

    def _row_sdpa(self, q, k_all, v_all, batch: ForwardBatch, b: int):
        """q [1, nh, T, hd] of batch entry b -> [1, nh, n, hd] for its n real queries, which
        see slots [0, start + i]: causal from slot 0, else an explicit prefix mask."""
        row, start, n = batch.rows[b], batch.starts[b], batch.lengths[b]
        keys, values = k_all[row : row + 1, :, : start + n], v_all[row : row + 1, :, : start + n]
        mask = None
        if start:
            slots = torch.arange(start + n, device=q.device)
            mask = slots[None, :] <= (start + torch.arange(n, device=q.device))[:, None]  # [n, start + n]
        return F.scaled_dot_product_attention(
            q[:, :, :n], keys, values, attn_mask=mask, is_causal=not start, enable_gqa=self.nkv != self.nh
        )


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
        self.silu_mul = None  # the kernel models' compiled silu(gate) * up (the one-call layer's), set by use_int8_kernels

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None and gate_up.dtype == torch.float32:
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused_block = None  # the whole layer in one compiled call (layer_rows.cpp), set by use_int8_kernels

    def forward(self, x, cos, sin, batch, cache, bias):
        if self.fused_block is not None:
            linears = self._kernel_linears(x, batch, cache)
            if linears is not None:  # the same ops from C++: the same bits, without a dozen Python calls
                a = self.self_attn
                return self.fused_block(x, *linears, cos, sin, cache.k[a.layer], cache.v[a.layer], batch.row_index,
                                        batch.slots, a.nh, a.nkv, a.hd**-0.5)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, bias)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _kernel_linears(self, x, batch, cache):
        """The four linears' bound kernels where this forward is one the fused attention takes
        and each linear would run its few-token kernel (fewer than WIDE_ROWS tokens), else None."""
        a = self.self_attn
        if a.fused_layer is None or not a._one_call(x, batch, cache):
            return None
        return self.bound_linears()

    def bound_linears(self):
        """qkv, o, gate_up and down's bound kernels (KernelLinear), or None where one has none."""
        a, m = self.self_attn, self.mlp
        bound = tuple(getattr(q, "kernel_linear", None) for q in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
        return None if None in bound else bound


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def fuse_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> this module's: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    out = dict(state)
    for key in state:
        for target, parts in fused.items():
            for suffix in ("weight", "bias"):
                if key.endswith(f"{parts[0]}.{suffix}"):
                    prefix = key[: -len(f"{parts[0]}.{suffix}")]
                    names = [f"{prefix}{p}.{suffix}" for p in parts]
                    out[f"{prefix}{target}.{suffix}"] = torch.cat([out.pop(n) for n in names])
    return out


class LlamaForCausalLM(DecoderBase):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_stack = None  # every layer in one compiled call (layer_rows.cpp), set by use_int8_kernels
        self.rope_table = None  # RoPE's cos / sin by position, built on the first forward (see _rope)
        self.register_buffer("inv_freq", inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    def use_int8_kernels(self, kernel) -> None:
        """For the int8, int4 and gguf models, with forerun's compiled kernels (models/int8_kernel.py):
        - each layer's two RMSNorms run inside the kernel of the one linear they feed
          (q/k/v, gate/up), and the layer's own norm call goes away;
        - chain attention over fewer than WIDE_ROWS tokens runs one query at a time.
        Together with the per-token linears this makes a forward batch-invariant: a
        drafted token scored among k others gets the bits plain decoding would give it,
        so speculative decoding reproduces plain decoding exactly at these precisions."""
        for layer in self.model.layers:
            for norm_name, linear in (("input_layernorm", layer.self_attn.qkv_proj), ("post_attention_layernorm", layer.mlp.gate_up_proj)):
                absorb = getattr(linear, "absorb_norm", None)  # Int8Linear, Int4Linear, GGUFLinear
                if absorb is not None and absorb(getattr(layer, norm_name)):
                    setattr(layer, norm_name, nn.Identity())
            # both norms inside their linears: the layer can run as one call
            folded = all(isinstance(n, nn.Identity) for n in (layer.input_layernorm, layer.post_attention_layernorm))
            layer.fused_block = getattr(kernel, "decoder_layer_rows", None) if folded else None
            layer.mlp.silu_mul = getattr(kernel, "silu_mul_rows", None)
        self.use_chain_attention_kernel(kernel)
        self.layer_stack = self._stack(kernel)
        # The final norm by the same compiled code as the layers' folded ones: torch's, called
        # once a forward right after the weights streamed through the caches, took ~200 us
        # of a 7 ms drafter forward (its code and data evicted); this one stays cached.
        self.model.norm.kernel = getattr(kernel, "rms_norm_rows", None)

    def _stack(self, kernel):
        """Every layer's one-call form from one call (layer_rows.cpp's LayerStack), bound to
        the linears as they are now: None where a layer has no one-call form."""
        layers = self.model.layers
        if getattr(kernel, "LayerStack", None) is None or any(layer.fused_block is None for layer in layers):
            return None
        bound = [layer.bound_linears() for layer in layers]
        if None in bound:
            return None
        a = layers[0].self_attn
        return kernel.LayerStack([k for four in bound for k in four], a.nh, a.nkv, a.hd**-0.5)

    def __getstate__(self):  # deepcopy / pickle: the stack holds this model's kernels; a copy runs layer by layer
        # until use_int8_kernels binds its own (to_int8_ / to_int4_ do)
        return {**super().__getstate__(), "layer_stack": None}

    def use_chain_attention_kernel(self, kernel) -> None:
        """Chain attention over fewer than WIDE_ROWS new tokens one query at a time (the
        compiled kernel; float32 K/V, as the int8 and float32 models keep them)."""
        for layer in self.model.layers:
            layer.self_attn.prefix_attention = kernel.attend_prefix
            layer.self_attn.fused_layer = getattr(kernel, "rope_write_attend", None)
            layer.self_attn.masked_attention = getattr(kernel, "attend_masked", None)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] of the positions (rope_cos_sin's values, by lookup)."""
        table = self.rope_table
        if table is None or table.source is not self.inv_freq or table.dtype != dtype:  # first call, moved, reloaded
            rope_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            table = self.rope_table = RopeTable(self.inv_freq.to(rope_dtype), dtype, source=self.inv_freq)
        return table(positions)

    def forward(
        self, batch: ForwardBatch, cache: KVCache, logits_at: torch.Tensor | str | None = "all",
        skip: frozenset[int] = frozenset(),
    ) -> ModelOutput:
        """The DecoderBase.forward contract."""
        cache.check_fits(batch)
        x = self.model.embed_tokens(batch.tokens)  # (B, T, C)
        cos, sin = self._rope(batch.positions, x.dtype)
        if self.layer_stack is not None and not skip and Attention._one_call(x, batch, cache):
            x = self.layer_stack(x, cos, sin, cache.k, cache.v, batch.row_index, batch.slots)
        else:
            # SDPA would turn a bool mask into an additive one in every layer: do it once here,
            # and not at all when SDPA's own rule is the same (one decode token, a fresh prefill).
            bias = attention_bias(batch, x.dtype)
            for i, layer in enumerate(self.model.layers):
                if i not in skip:
                    x = layer(x, cos, sin, batch, cache, bias)
        hidden = self.model.norm(x)
        return ModelOutput(hidden, self.head(hidden, logits_at))
