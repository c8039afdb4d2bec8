"""The one seam between a decoder and the code that computes its attention, fused norms and
whole layers: a backend object, chosen once when the model is finished (models/loader.py,
`choose_backend`) and held by the model (`model.backend`), instead of nullable attributes set
on its modules from outside.

- `TorchBackend`: plain PyTorch (SDPA, torch's norms). Every model starts with it; bfloat16,
  accelerators and the float32 model without kernels keep it.
- `CpuKernels`: forerun's compiled CPU kernels (kernels/*.cpp). Every query attends on its
  own (RoPE and the cache write folded in where the attention's projections allow it), in
  a chain or a token tree, a decoding step or a 4k-token prompt alike; with `fused=True`
  (int8, int4, gguf: the linears carry their norms), silu(gate) * up, the final norm, a whole
  layer and the whole layer stack run as single calls where a forward has fewer than
  WIDE_ROWS tokens. Each gives a token the bits it would get alone, so a forward is
  batch-invariant: speculative output equals plain output (tests/test_int8_identity.py,
  test_gguf_native.py, test_int4.py), and a prompt's K/V are the same bits whether it was
  prefilled whole, in chunks, or decoded token by token, so a cached prefix can stand in
  for a computed one (tests/test_prefill_invariance.py).

A CUDA backend would be a third class with the same methods. Each method that may decline
returns None where its fast path does not take the forward (the caller then runs the plain
ops); `attend`, `silu_mul` and `final_norm` always answer. The kernels read float32
activations and a float32 or float16 cache (LLM's kv_cache_dtype="float16": they widen the
rows they read to float32 and round what they write to float16, the bits torch's writes
store); both dtypes are checked (`takes`), so a bfloat16 cache falls back to torch instead of
handing the kernels the wrong bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forerun.kv.cache import ForwardBatch, KVCache, widened
from forerun.kv.paged import PagedKVCache

WIDE_ROWS = 64  # forwards of fewer tokens take the one-call layer (the linears' few-token kernels)


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


def sdpa(attn, q: torch.Tensor, batch: ForwardBatch, cache, bias) -> torch.Tensor:
    """SDPA over the batch's rows: q [B, nh, T, hd] -> [B, nh, T, hd]."""
    keys, values = cache.read(attn.layer, batch)  # (B, nkv, S, hd)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=bias, is_causal=batch.attention == "causal", enable_gqa=attn.nkv != attn.nh
    )


class TorchBackend:
    """Plain PyTorch: what every op computes without forerun's kernels."""

    name = "torch"
    prefill_sdpa = True  # prompts (rows of WIDE_ROWS or more new tokens) go through SDPA

    def layer_stack(self, model, x, cos, sin, batch: ForwardBatch, cache) -> torch.Tensor | None:
        return None

    def layer(self, layer, x, cos, sin, batch: ForwardBatch, cache) -> torch.Tensor | None:
        return None

    def attention(self, attn, x, cos, sin, batch: ForwardBatch, cache) -> torch.Tensor | None:
        """RoPE, the cache write and attention in one call: [B, T, nh * hd], or None."""
        return None

    def attend(self, attn, q: torch.Tensor, batch: ForwardBatch, cache, bias) -> torch.Tensor:
        """q [B, nh, T, hd] (RoPE applied, K/V written) -> [B, nh, T, hd]. bias: [B, 1, T, S]
        additive mask, or None where batch.attention names a rule SDPA applies itself."""
        if q.shape[2] == 1 and batch.attention == "all" and q.dtype in (torch.float32, torch.float64):
            return one_query_attention(q, *cache.read(attn.layer, batch))  # plain decoding: the most frequent forward
        return sdpa(attn, q, batch, cache, bias)

    def masked_kernel(self, q: torch.Tensor, cache):
        """The per-query attention under a bool mask over `cache`, as kernel(q, layer, rows,
        mask [B, T, S], scale), where it takes q and the cache (Gemma's layers split rows by
        length around it), else None."""
        return None

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def final_norm(self, norm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def __repr__(self) -> str:
        return "TorchBackend()"


@dataclass
class CpuKernels(TorchBackend):
    """forerun's compiled CPU kernels. The flags name each path, so a test can switch one off
    (`dataclasses.replace(model.backend, fused_layer=False)`, then `model.set_backend`) and
    check that the bits do not change."""

    kernel: object = field(repr=False)  # the extension module (kernels/loader.py)
    fused: bool = False  # int8 / int4 / gguf: silu_mul, the final norm, one-call layers and the stack
    per_query: bool = True  # attend_prefix: chain attention one query at a time
    fused_layer: bool = True  # rope_write_attend: RoPE, cache write and chain attention in one call
    masked: bool = True  # attend_masked: token trees one query at a time
    one_call: bool = True  # decoder_layer_rows: a whole layer in one call (with fused and fused_layer)
    stacked: bool = True  # LayerStack: every layer in one call (with one_call)
    # Rows of WIDE_ROWS or more new tokens (prompts) through SDPA's flash kernel, each row alone
    # (the path before prefill was batch-invariant): a prompt's K/V then differ in bits from
    # what decoding computes, so a prefix-cache hit or a chunked prefill may change tokens.
    prefill_sdpa: bool = False
    stack: object = field(default=None, repr=False)  # the LayerStack bound to one model's linears (bind)

    name = "cpu-kernels"

    # --- when a path takes a forward -------------------------------------------------------

    @staticmethod
    def takes(x: torch.Tensor, cache) -> bool:
        """The kernels read float32 activations and a float32 or float16 K/V cache."""
        return x.dtype == torch.float32 and cache.dtype in (torch.float32, torch.float16)

    def chain(self, x, batch: ForwardBatch, cache) -> bool:
        """A chain over forerun's own row cache or paged pool (the kernels read its blocks through
        its tables), in float32."""
        return (batch.starts is not None and isinstance(cache, (KVCache, PagedKVCache)) and self.takes(x, cache)
                and (not self.prefill_sdpa or max(batch.lengths) < WIDE_ROWS))

    def few_tokens(self, x, batch: ForwardBatch, cache) -> bool:
        """A forward the one-call layer (and the layer stack) takes: a chain whose linears run
        their few-token kernel (fewer than WIDE_ROWS tokens in all)."""
        return x.shape[0] * x.shape[1] < WIDE_ROWS and self.chain(x, batch, cache)

    # --- whole layers ----------------------------------------------------------------------

    def bind(self, model) -> CpuKernels:
        """This backend with every layer's one-call form bound to `model`'s linears as they
        are now (layer_rows.cpp's LayerStack), where each layer has one."""
        stack = None
        if self._layers_in_one_call() and self.stacked and getattr(self.kernel, "LayerStack", None) is not None:
            layers = model.model.layers
            # (a decoder without a one-call form, Gemma's, runs its layers from Python)
            bound = [layer.bound_linears() if getattr(layer, "one_call_form", bool)() else None for layer in layers]
            if None not in bound:
                a = layers[0].self_attn
                stack = self.kernel.LayerStack([k for four in bound for k in four], a.nh, a.nkv, a.hd**-0.5)
        return dataclasses.replace(self, stack=stack)

    def layer_stack(self, model, x, cos, sin, batch, cache):
        if self.stack is None or not self.few_tokens(x, batch, cache):
            return None
        return self.stack(x, cos, sin, *cache.pools, batch.row_index, batch.slots, cache.tables)

    def layer(self, layer, x, cos, sin, batch, cache):
        """The whole layer in one compiled call (layer_rows.cpp: the same ops, the same bits)."""
        if not (self._layers_in_one_call() and layer.one_call_form() and self.few_tokens(x, batch, cache)):
            return None
        linears = layer.bound_linears()
        if linears is None:
            return None
        a, (k, v) = layer.self_attn, cache.pools
        return self.kernel.decoder_layer_rows(x, *linears, cos, sin, k[a.layer], v[a.layer], batch.row_index,
                                              batch.slots, a.nh, a.nkv, a.hd**-0.5, cache.tables)

    def _layers_in_one_call(self) -> bool:
        return self.fused and self.fused_layer and self.one_call

    # --- attention -------------------------------------------------------------------------

    def attention(self, attn, x, cos, sin, batch, cache):
        if not (self.fused_layer and attn.plain_qkv and self.chain(x, batch, cache)):
            return None
        k, v = cache.pools
        return self.kernel.rope_write_attend(attn.qkv_proj(x), cos, sin, k[attn.layer], v[attn.layer], batch.row_index,
                                             batch.slots, attn.nh, attn.nkv, attn.hd**-0.5, cache.tables)

    def attend(self, attn, q, batch, cache, bias):
        if self.per_query and batch.starts is not None and self.takes(q, cache):
            return self._chain_attention(attn, q, batch, cache)
        if self.masked and batch.attention == "mask" and self.takes(q, cache):
            # a token tree: per query too, so a node on the accepted path gets its chain's bits
            k, v = cache.pools
            return self.kernel.attend_masked(q, k[attn.layer], v[attn.layer], batch.row_index, batch.mask[:, 0],
                                             attn.hd**-0.5, cache.tables)
        return super().attend(attn, q, batch, cache, bias)

    def _chain_attention(self, attn, q, batch: ForwardBatch, cache):
        """Chain attention one query at a time: each query's keys in one fixed order, the same
        instructions whatever chunk or batch it falls in. With prefill_sdpa, a row of WIDE_ROWS
        or more new tokens goes through SDPA's flash kernel on that row alone instead (its bits
        still never depend on its batch-mates, but differ from decoding's)."""
        scale = attn.hd**-0.5
        k, v = cache.pools
        k_all, v_all, tables = k[attn.layer], v[attn.layer], cache.tables
        long = [b for b, n in enumerate(batch.lengths) if n >= WIDE_ROWS] if self.prefill_sdpa else []
        if not long:
            return self.kernel.attend_prefix(q, k_all, v_all, batch.row_index, batch.slots + 1, scale, tables)
        out = torch.zeros_like(q)  # (B, nh, T, hd); padded queries stay 0 (nobody reads them)
        for b in long:  # (cache.k: rows [rows, nkv, S, hd] of either cache, a paged one's gathered)
            out[b : b + 1, :, : batch.lengths[b]] = _row_sdpa(attn, q[b : b + 1], cache.k[attn.layer],
                                                              cache.v[attn.layer], batch, b)
        short = [b for b, n in enumerate(batch.lengths) if n < WIDE_ROWS]
        if short:
            idx = torch.tensor(short, device=q.device)
            out[idx] = self.kernel.attend_prefix(q[idx], k_all, v_all, batch.row_index[idx], batch.slots[idx] + 1,
                                                 scale, tables)
        return out

    def masked_kernel(self, q, cache):
        if not (self.masked and self.takes(q, cache)):
            return None
        k, v = cache.pools
        return lambda q, layer, rows, mask, scale: self.kernel.attend_masked(q, k[layer], v[layer], rows, mask, scale,
                                                                            cache.tables)

    # --- small fused ops -------------------------------------------------------------------

    def silu_mul(self, gate_up):
        if self.fused and gate_up.dtype == torch.float32:
            return self.kernel.silu_mul_rows(gate_up)
        return super().silu_mul(gate_up)

    def final_norm(self, norm, x):
        # The final norm by the same compiled code as the layers' folded ones: torch's, called
        # once a forward right after the weights streamed through the caches, took ~200 us
        # of a 7 ms drafter forward (its code and data evicted); this one stays cached.
        if self.fused and x.dtype == torch.float32 and hasattr(norm, "weight") and hasattr(norm, "eps"):
            return self.kernel.rms_norm_rows(x, norm.weight, norm.eps)
        return norm(x)

    def __deepcopy__(self, memo) -> CpuKernels:
        """A deep copy of a model runs layer by layer until its own stack is bound (the stack
        holds the original's linears); the extension module is shared, never copied."""
        return dataclasses.replace(self, stack=None)


def _row_sdpa(attn, q, k_all, v_all, batch: ForwardBatch, b: int):
    """q [1, nh, T, hd] of batch entry b -> [1, nh, n, hd] for its n real queries, which
    see slots [0, start + i]: causal from slot 0, else an explicit prefix mask."""
    row, start, n = batch.rows[b], batch.starts[b], batch.lengths[b]
    keys, values = widened(k_all[row : row + 1, :, : start + n]), widened(v_all[row : row + 1, :, : start + n])
    mask = None
    if start:
        slots = torch.arange(start + n, device=q.device)
        mask = slots[None, :] <= (start + torch.arange(n, device=q.device))[:, None]  # [n, start + n]
    return F.scaled_dot_product_attention(
        q[:, :, :n], keys, values, attn_mask=mask, is_causal=not start, enable_gqa=attn.nkv != attn.nh
    )


def choose_backend(kernel, fused: bool) -> TorchBackend:
    """The backend for a model finished on the CPU: its kernels where they loaded, else torch."""
    return TorchBackend() if kernel is None else CpuKernels(kernel, fused=fused)
