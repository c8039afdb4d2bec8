"""A paged KV cache: K/V live in a pool of fixed-size blocks, and each cache row reads and
writes through its sequence's block table. Same interface as kv_cache.KVCache (write, read,
check_fits, truncate, move, lengths, k/v per layer), so the models and the engine run on it
unchanged, and position-indexing stays the rule: slot s of row r is offset s % block_size
of block tables[r][s // block_size].

What it costs: attention reads a row's keys as one contiguous run of slots (SDPA and the
int8 / float32 chain-attention kernels take [rows, H, S, D] tensors), so `read` and `k[layer]`
/ `v[layer]` gather the batch rows' blocks into a contiguous tensor for each layer of each
forward: one extra copy of the K/V a forward attends to. In exchange the pool holds only the
blocks sequences use (the row cache preallocates rows x max_len), and the bits are the same
(the gathered values are the stored values, tested with the exactness tests).
Table entries past a row's blocks point at a scratch block that no sequence owns, so the
padding queries of a ragged batch write there instead of into another sequence's blocks.
"""
from __future__ import annotations

import torch

from forerun.kv_cache import ForwardBatch


class _LayerViews:
    """cache.k[layer] / cache.v[layer] for the kernels: the rows of the forward that last
    wrote this layer, materialised from their blocks as [rows, H, S, D] indexed by cache row."""

    def __init__(self, cache: "PagedKVCache", pools: list[torch.Tensor]):
        self.cache, self.pools = cache, pools

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.cache._materialise(self.pools[layer])

    def __len__(self) -> int:
        return len(self.pools)


class PagedKVCache:
    def __init__(self, model, rows: int, capacity: int, num_blocks: int, block_size: int):
        c = model.config
        shape = (num_blocks + 1, c.num_key_value_heads, block_size, c.head_dim)  # + the scratch block
        self.k_pool = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.v_pool = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.block_size, self.capacity, self.scratch = block_size, capacity, num_blocks
        self.width = -(-capacity // block_size)  # table entries per row
        self.tables = torch.full((rows, self.width), num_blocks, dtype=torch.long, device=model.device)  # [rows, width]
        self.lengths = [0] * rows
        self.k, self.v = _LayerViews(self, self.k_pool), _LayerViews(self, self.v_pool)
        self._batch: ForwardBatch | None = None
        self._where: tuple[torch.Tensor, torch.Tensor] | None = None  # (block [B, T], offset [B, T])

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def set_table(self, row: int, blocks: list[int]) -> None:
        """Row `row` now reads and writes through `blocks` (its sequence's table, position order)."""
        self.tables[row].fill_(self.scratch)
        if blocks:
            self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long, device=self.tables.device)
        self._batch = None

    def _locate(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch is not self._batch:  # once per forward, not per layer
            rows = batch.row_index[:, None]
            self._where = (self.tables[rows, batch.slots // self.block_size], batch.slots % self.block_size)
            self._batch = batch
        return self._where

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, H_kv, T, D] for the batch's (rows, slots)."""
        block, offset = self._locate(batch)
        self.k_pool[layer][block, :, offset] = k.transpose(1, 2)  # value [B, T, H, D]
        self.v_pool[layer][block, :, offset] = v.transpose(1, 2)

    def check_fits(self, batch: ForwardBatch):
        if batch.kv_len > self.capacity:
            raise IndexError(f"forward reaches slot {batch.kv_len - 1}, KV capacity is {self.capacity}")

    def _gather(self, pool: torch.Tensor, row_index: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, H, nb * block_size, D]: the rows' first nb = ceil(kv_len / block_size) blocks."""
        nb = -(-kv_len // self.block_size)
        blocks = pool[self.tables[row_index, :nb]]  # [B, nb, H, bs, D]
        B, _, H, bs, D = blocks.shape
        return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)

    def read(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, S) for the batch's rows: [B, H_kv, S, D] each."""
        S = batch.kv_len
        return (self._gather(self.k_pool[layer], batch.row_index, S)[:, :, :S],
                self._gather(self.v_pool[layer], batch.row_index, S)[:, :, :S])

    def _materialise(self, pool: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        if batch is None:
            raise RuntimeError("a paged cache's k/v views exist only inside a forward, after its write")
        rows = self._gather(pool, batch.row_index, batch.kv_len)
        if batch.rows == list(range(len(batch.rows))):
            return rows  # rows 0 .. B-1: already indexed by cache row
        out = torch.empty((self.num_rows,) + rows.shape[1:], dtype=rows.dtype, device=rows.device)
        out[batch.row_index] = rows
        return out

    def truncate(self, row: int, length: int):
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[row] = length

    def move(self, row: int, src_slots: list[int], dst_slots: list[int]):
        """Copy entries src -> dst in every layer (token-tree compaction of the accepted path)."""
        table, bs = self.tables[row], self.block_size
        src, dst = torch.tensor(src_slots, device=table.device), torch.tensor(dst_slots, device=table.device)
        sb, so, db, do = table[src // bs], src % bs, table[dst // bs], dst % bs
        for kk, vv in zip(self.k_pool, self.v_pool):
            kk[db, :, do] = kk[sb, :, so]
            vv[db, :, do] = vv[sb, :, so]
