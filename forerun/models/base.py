"""What every forerun decoder shares: its output contract, placement, cache, LM head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forerun.kernels.backend import TorchBackend
from forerun.kv.cache import ForwardBatch, KVCache, chain_batch
from forerun.precision import kv_dtype_for


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim) with its N(0, 1) init (the same draws), skipped on the meta device,
    where the loader fills the weights anyway: there `normal_` runs torch's Python reference,
    whose first call imports torch._dynamo (1.1-1.7 s of every model load)."""
    weight = torch.empty(num, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [B, T, hidden_size] after the final norm (what the LM head reads)
    logits: torch.Tensor | None  # [B, T', vocab] for the requested positions, or None


class DecoderBase(nn.Module):
    """Subclasses define `config`, `model.norm`, `model.embed_tokens`, `lm_head` and forward().
    `backend` (kernels/backend.py) computes attention and the fused ops: plain torch until the
    loader finishes the model with forerun's kernels (set_backend). Every cache of the model
    (the engine's, the server's, a draft model's, `score`'s) comes from `new_cache`, in
    `kv_dtype`: the model's own dtype unless the loader's Precision names another (set_kv_cache)."""

    backend = TorchBackend()  # (a class default: every model starts on plain torch)
    _kv_dtype: torch.dtype | None = None  # None: the model's dtype

    def set_backend(self, backend: TorchBackend) -> None:
        """Compute with `backend` from here on, bound to the linears as they are now (a backend
        that holds per-model state, the kernels' layer stack, binds it here)."""
        bind = getattr(backend, "bind", None)
        self.backend = bind(self) if bind is not None else backend

    def set_kv_cache(self, kv_cache: str) -> None:
        """Keys and values in the dtype `kv_cache` names ("auto": the model's; "float32";
        "float16": lossy, half the bytes, float32 models only) in every cache made from here on."""
        dtype = kv_dtype_for(kv_cache, self.dtype)  # (checked against this model's activations)
        self._kv_dtype = None if kv_cache == "auto" else dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the keys and values in this model's caches."""
        return self._kv_dtype or self.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def forward(
        self, batch: ForwardBatch, cache: KVCache, logits_at: torch.Tensor | str | None = "all",
        skip: frozenset[int] = frozenset(),
    ) -> ModelOutput:
        """Run batch.tokens through every layer, writing K/V into `cache`.

        logits_at: "all" (every position), None (no LM head: prefill), or an index tensor
        [B, T'] of positions per row whose logits are wanted.
        skip: layer indices to leave out (self-speculative drafting); they neither read
        nor write the cache.
        """
        raise NotImplementedError

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, capacity, c.head_dim, self.kv_dtype, self.device)

    def head(self, hidden: torch.Tensor, logits_at) -> torch.Tensor | None:
        """Logits at "all" positions, none (None), or an index tensor [B, T'] per row.
        bfloat16 logits are returned as float32: sampling needs the resolution."""
        if logits_at is None:
            return None
        h = hidden if isinstance(logits_at, str) else hidden.gather(1, logits_at[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self.lm_head(h)
        return logits.float() if logits.dtype == torch.bfloat16 else logits

    def hidden_to_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] rows after the final norm -> [..., vocab] the model's own logits
        for them (its LM head; drafters that share it, Medusa and EAGLE heads, call this)."""
        return self.head(hidden, "all")

    @torch.inference_mode()
    def score(self, ids: list[int], skip: frozenset[int] = frozenset(), last_only: bool = False) -> torch.Tensor:
        """Teacher-forced logits of one sequence in a fresh cache: [T, V] (or [V] for the last)."""
        at = torch.tensor([[len(ids) - 1]], device=self.device) if last_only else "all"
        logits = self(chain_batch([ids], [0], [0], self.device), self.new_cache(1, len(ids)), logits_at=at, skip=skip).logits[0]
        return logits[0] if last_only else logits
