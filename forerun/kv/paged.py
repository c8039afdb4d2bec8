"""A paged KV cache: K/V live in a pool of fixed-size blocks, and each cache row reads and
writes through its sequence's block table. Same interface as kv_cache.KVCache (write, read,
check_fits, truncate, move, lengths, k/v per layer), so the models and the engine run on it
unchanged, and position-indexing stays the rule: slot s of row r is offset s % block_size
of block tables[r][s // block_size].

Who reads it how: forerun's kernels (kernels/attention_rows.cpp) take the pools and the block
tables (`pools`, `tables`) and read and write the blocks where they lie, so the server runs
the one-call layers `LLM` runs, and a row's bits are the row cache's. Torch's attention (SDPA,
the bfloat16 and accelerator paths) reads a row's keys as one run of slots, so `read` and
`k[layer]` / `v[layer]` gather the batch rows' blocks into reused buffers for each layer of
each forward (two copies, and buffers of 4 / num_layers of a row cache). In exchange for the
tables, the pool holds only the blocks sequences can use (the row cache preallocates rows x
max_len).
Table entries past a row's blocks point at a scratch block that no sequence owns, so the
padding queries of a ragged batch write there instead of into another sequence's blocks.
"""
from __future__ import annotations

import torch

from forerun.kv.cache import ForwardBatch, KVCache, lazy_zeros, widened


class _LayerViews:
    """cache.k[layer] / cache.v[layer] for the kernels: the rows of the forward that last
    wrote this layer, materialised from their blocks as [rows, H, S, D] indexed by cache row."""

    def __init__(self, cache: "PagedKVCache", which: int):
        self.cache, self.which = cache, which  # 0 = keys, 1 = values

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.cache._materialise(self.which, layer)

    def __len__(self) -> int:
        return len(self.cache.k_pool)


class PagedKVCache:
    def __init__(self, model, rows: int, capacity: int, num_blocks: int, block_size: int):
        c = model.config
        shape = (num_blocks + 1, c.num_key_value_heads, block_size, c.head_dim)  # + the scratch block
        dtype = model.kv_dtype  # the model's, or float16 (kv_cache_dtype)
        # (memory the OS commits as blocks are first written: a pool sized by a budget costs what is used)
        self.k_pool = [lazy_zeros(shape, dtype, model.device) for _ in range(c.num_hidden_layers)]
        self.v_pool = [lazy_zeros(shape, dtype, model.device) for _ in range(c.num_hidden_layers)]
        self.block_size, self.capacity, self.scratch = block_size, capacity, num_blocks
        self.width = -(-capacity // block_size)  # table entries per row
        self.tables = torch.full((rows, self.width), num_blocks, dtype=torch.long, device=model.device)  # [rows, width]
        self.lengths = [0] * rows
        self.k, self.v = _LayerViews(self, 0), _LayerViews(self, 1)
        # Gather buffers, reused by every layer (a fresh 2-8 MB tensor per layer costs page faults):
        # 2 x (keys, values) of one layer at full size, i.e. 4 / num_layers of a row cache.
        H, D = c.num_key_value_heads, c.head_dim
        new = lambda *shape: torch.empty(shape, dtype=dtype, device=model.device)  # noqa: E731
        self._flat = [new(rows * self.width, H, block_size, D) for _ in range(2)]
        self._rows = [new(rows, H, self.width * block_size, D) for _ in range(2)]
        self._batch: ForwardBatch | None = None
        self._where: tuple[torch.Tensor, torch.Tensor] | None = None  # (block [B, T], offset [B, T])

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        """The keys' and values' dtype."""
        return self.k_pool[0].dtype

    @property
    def pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V pools per layer as the kernels read them, [blocks + 1, H_kv, block_size, D],
        through `tables` [rows, width] (int64 block ids; entries past a row's blocks: scratch)."""
        return self.k_pool, self.v_pool

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
        # value [B, T, H, D], in the pool's dtype (index_put does not convert: a float16 pool
        # takes each element rounded to nearest, as KVCache.write and the kernels store it)
        self.k_pool[layer][block, :, offset] = k.transpose(1, 2).to(self.dtype)
        self.v_pool[layer][block, :, offset] = v.transpose(1, 2).to(self.dtype)

    def check_fits(self, batch: ForwardBatch):
        if batch.kv_len > self.capacity:
            raise IndexError(f"forward reaches slot {batch.kv_len - 1}, KV capacity is {self.capacity}")

    def _gather(self, which: int, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """The batch rows' blocks copied into a reused [rows, H, width * block_size, D] buffer
        at their cache rows (other rows hold stale data nobody reads). Two copies per call:
        index_select of the blocks, then their transpose into the slot-major layout."""
        pool = (self.k_pool, self.v_pool)[which][layer]
        nb, B, bs = -(-batch.kv_len // self.block_size), len(batch.rows), self.block_size
        flat = self._flat[which][: B * nb]  # [B * nb, H, bs, D]
        torch.index_select(pool, 0, self.tables[batch.row_index, :nb].reshape(-1), out=flat)
        H, D = flat.shape[1], flat.shape[3]
        rows = flat.view(B, nb, H, bs, D).transpose(1, 2).reshape(B, H, nb * bs, D)
        out = self._rows[which]
        if batch.rows == list(range(batch.rows[0], batch.rows[0] + B)):
            out[batch.rows[0] : batch.rows[0] + B, :, : nb * bs] = rows
        else:
            out[batch.row_index, :, : nb * bs] = rows
        return out

    def read(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, S) for the batch's rows: [B, H_kv, S, D] each, widened."""
        S = batch.kv_len
        idx = KVCache._rows_index(batch)
        return widened(self._gather(0, layer, batch)[idx, :, :S]), widened(self._gather(1, layer, batch)[idx, :, :S])

    def _materialise(self, which: int, layer: int) -> torch.Tensor:
        if self._batch is None:
            raise RuntimeError("a paged cache's k/v views exist only inside a forward, after its write")
        return self._gather(which, layer, self._batch)

    def truncate(self, row: int, length: int):
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[row] = length

    def _slot_index(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.arange(lo, hi, device=self.tables.device)
        return self.tables[row, slots // self.block_size], slots % self.block_size

    def export_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [lo, hi) of `row`, every layer: [layers, H_kv, hi - lo, D] each (a copy)."""
        block, offset = self._slot_index(row, lo, hi)
        # pool[block, :, offset]: [n, H, D] (advanced indices first) -> [H, n, D]
        return (torch.stack([k[block, :, offset].transpose(0, 1) for k in self.k_pool]),
                torch.stack([v[block, :, offset].transpose(0, 1) for v in self.v_pool]))

    def import_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [layers, H_kv, n, D] at slots [lo, lo + n) of `row` (through its table)."""
        block, offset = self._slot_index(row, lo, lo + k.shape[2])
        for layer, (kp, vp) in enumerate(zip(self.k_pool, self.v_pool)):
            kp[block, :, offset] = k[layer].transpose(0, 1)
            vp[block, :, offset] = v[layer].transpose(0, 1)
        self._batch = None

    def import_blocks(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [blocks, layers, H_kv, n, D] at slots [lo, lo + blocks * n) of `row`: runs
        that are whole pool blocks (n the block size, lo on a block's start) copied a block at a
        time, else slot by slot."""
        nb, layers, H, n, D = k.shape
        if n != self.block_size or lo % n:
            flat = lambda x: x.permute(1, 2, 0, 3, 4).reshape(layers, H, nb * n, D)  # noqa: E731
            return self.import_slots(row, lo, flat(k), flat(v))
        blocks = self.tables[row, lo // n : lo // n + nb]
        for layer, (kp, vp) in enumerate(zip(self.k_pool, self.v_pool)):
            kp.index_copy_(0, blocks, k[:, layer])
            vp.index_copy_(0, blocks, v[:, layer])
        self._batch = None

    def move(self, row: int, src_slots: list[int], dst_slots: list[int]):
        """Copy entries src -> dst in every layer (token-tree compaction of the accepted path)."""
        table, bs = self.tables[row], self.block_size
        src, dst = torch.tensor(src_slots, device=table.device), torch.tensor(dst_slots, device=table.device)
        sb, so, db, do = table[src // bs], src % bs, table[dst // bs], dst % bs
        for kk, vv in zip(self.k_pool, self.v_pool):
            kk[db, :, do] = kk[sb, :, so]
            vv[db, :, do] = vv[sb, :, so]
