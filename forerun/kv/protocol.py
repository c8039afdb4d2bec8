"""The one protocol every KV cache keeps: what a decoder's attention and the generate loop call.

Two caches keep it: `KVCache` (kv/cache.py: a preallocated [rows, H_kv, capacity, D] pair per
layer, for `LLM`) and `PagedKVCache` (kv/paged.py: fixed-size blocks from one pool, each row
reading through its block table, for the server). A model takes either, in the model's dtype
or float16 (kv_cache_dtype: `read` widens to float32, the kernels read float16 themselves). Position-indexed: slot s of a row holds the token at position s, so a
rejected draft needs no rollback (`truncate` moves the length, later writes overwrite).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from forerun.kv.cache import ForwardBatch


@runtime_checkable
class KVStore(Protocol):
    lengths: list[int]  # host-side, per row: slots [0, length) hold committed tokens
    capacity: int  # slots per row
    k: object  # per layer, indexable: the layer's keys as rows [rows, H_kv, S, D] (a paged cache gathers them)
    v: object
    # What forerun's kernels read: per layer K and V as rows [rows, H_kv, capacity, D] (tables
    # None), or a block pool [blocks, H_kv, block_size, D] read through tables [rows, width].
    tables: torch.Tensor | None

    @property
    def pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype:
        """The keys' and values' dtype as stored (the kernels read float32 and float16)."""

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, H_kv, T, D] for the batch's (rows, slots)."""

    def check_fits(self, batch: ForwardBatch) -> None:
        """Raises IndexError where the forward would write past the capacity (once per forward)."""

    def read(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, kv_len) for the batch's rows: [B, H_kv, S, D] each, a float16
        cache's widened to float32 (what torch's attention computes with)."""

    def truncate(self, row: int, length: int) -> None:
        """Keep slots [0, length) of `row`."""

    def export_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [lo, hi) of `row`, every layer: [layers, H_kv, hi - lo, D] (the prefix cache)."""

    def import_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [layers, H_kv, n, D] at slots [lo, lo + n) of `row`."""

    def import_blocks(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [blocks, layers, H_kv, n, D] (runs of n tokens, e.g. the prefix cache's
        blocks stacked) at slots [lo, lo + blocks * n) of `row`: import_slots' bits, fewer copies."""

    def move(self, row: int, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy entries src -> dst in every layer (a token tree's accepted path, compacted)."""
