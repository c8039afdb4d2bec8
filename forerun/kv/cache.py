"""Position-indexed KV cache and the per-forward batch description.

Every sequence owns one cache *row*. A token's keys/values live at the row's *slot*
equal to its position in the sequence, so:
  - a rejected draft needs no rollback: `truncate(row, n)` only moves the write cursor,
    and the stale entries past it are overwritten by the next forward;
  - attention visibility is a mask over slots (`ForwardBatch.mask`), so a chain is the
    causal rule `key_slot <= query_slot` and a token tree is an ancestor mask over the
    drafted slots, after which `move()` compacts the accepted path to consecutive slots.
A paged cache keeps this interface: slots become (block, offset) through a block table.

Keys and values are stored in the cache's dtype: the model's, or float16 over float32
activations (LLM's kv_cache_dtype="float16": half the bytes, each element rounded to nearest
float16 as it is written). Attention computes in float32 either way: the kernels widen the
rows they read, and `read` hands torch's attention widened copies (`widened`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One model forward over B cache rows, T new tokens each (right-padded)."""

    tokens: torch.Tensor  # [B, T] int64 token ids (padding: any valid id)
    positions: torch.Tensor  # [B, T] int64 RoPE positions
    slots: torch.Tensor  # [B, T] int64 cache slots written by this forward
    rows: list[int]  # [B] cache row of each batch entry
    kv_len: int  # S: this forward reads slots [0, S) of each row
    # [B, 1, T, S] bool, True = query may attend to key slot; None: a chain's rule (key slot <=
    # query slot), built when `mask` is first read (the compiled one-call layers never read it)
    given_mask: torch.Tensor | None
    starts: list[int] | None = None  # chains only: row b writes slots starts[b] .. starts[b] + T - 1
    row_index: torch.Tensor | None = None  # [B] rows on the device, built once per forward
    # What `mask` amounts to, so the model can use attention's built-in rules (faster):
    # "all" = every query sees slots [0, kv_len); "causal" = query i sees slots <= i (every
    # row starts at slot 0); "mask" = anything else (ragged rows, trees): use `mask`.
    attention: str = "mask"
    lengths: list[int] | None = None  # chains only: real (unpadded) new tokens per row

    def __post_init__(self):
        if self.row_index is None:
            self.row_index = torch.tensor(self.rows, device=self.tokens.device)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, T, S] bool, True = query may attend to key slot."""
        if self.given_mask is not None:
            return self.given_mask
        keys = torch.arange(self.kv_len, device=self.slots.device)
        return (keys[None, None, :] <= self.slots[:, :, None])[:, None]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros whose memory the OS commits as it is first written (on the CPU): numpy's zeros come
    from calloc, which for large blocks maps fresh zero pages instead of writing them, where
    torch.zeros writes every byte at once. So a cache sized for a long context costs only the
    slots sequences have reached. 64-byte aligned, as torch's own allocations, and a tensor of
    its own (not a view: autograd may write into it, as training does). Elsewhere (an
    accelerator) torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    n = 1
    for d in shape:
        n *= d
    item = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(n * item + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64  # bytes to the first 64-byte boundary (a multiple of 16: of item too)
    out = torch.empty(0, dtype=dtype)
    # (the storage keeps the numpy buffer alive)
    return out.set_(torch.from_numpy(raw).untyped_storage(), skip // item, tuple(shape))


def widened(t: torch.Tensor) -> torch.Tensor:
    """A float16 cache's keys or values as the float32 attention computes with (exact: every
    float16 is a float32); any other dtype as it is (no copy)."""
    return t.float() if t.dtype == torch.float16 else t


def chain_batch(
    new_tokens: list[list[int]], starts: list[int], rows: list[int], device: torch.device
) -> ForwardBatch:
    """Each row b appends new_tokens[b] at slots starts[b], starts[b]+1, ...

    Rows with fewer tokens are right-padded by repeating their last token; a padded
    query sits *after* every real query of its row, so under the causal slot rule no
    real query ever sees it, and its cache entry is past the row's length (stale).
    >>> b = chain_batch([[5, 6], [7]], [3, 0], [0, 1], torch.device("cpu"))
    >>> b.positions.tolist(), b.kv_len
    ([[3, 4], [0, 1]], 5)
    """
    T = max(len(t) for t in new_tokens)
    padded = [t + [t[-1]] * (T - len(t)) for t in new_tokens]
    tokens = torch.tensor(padded, dtype=torch.long, device=device)
    slots = torch.tensor([range(s, s + T) for s in starts], dtype=torch.long, device=device)
    kv_len = max(starts) + T
    # Equal starts: every row has exactly the slots [0, start) committed, so a row's rule is
    # plain causality (its padding sits after its real queries and nobody sees it).
    attention = "mask"
    if len(set(starts)) == 1:
        attention = "all" if T == 1 else "causal" if starts[0] == 0 else "mask"
    lengths = [len(t) for t in new_tokens]
    return ForwardBatch(tokens, slots, slots, list(rows), kv_len, None, list(starts), attention=attention, lengths=lengths)


class KVCache:
    """Preallocated keys/values, one [rows, H_kv, capacity, D] tensor pair per layer."""

    def __init__(self, num_layers, rows, num_kv_heads, capacity, head_dim, dtype, device):
        shape = (rows, num_kv_heads, capacity, head_dim)
        self.k = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]  # (memory taken as slots are written)
        self.v = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.lengths = [0] * rows  # host-side: slots [0, length) hold committed tokens
        self.capacity = capacity

    tables = None  # (a paged cache's block tables: none, the kernels read rows)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        """The keys' and values' dtype."""
        return self.k[0].dtype

    @property
    def pools(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and V tensors per layer as the kernels read them: [rows, H_kv, capacity, D]."""
        return self.k, self.v

    @staticmethod
    def _rows_index(batch: ForwardBatch):
        """A slice when rows are consecutive (no gather copy), else the index tensor."""
        rows = batch.rows
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return batch.row_index

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, H_kv, T, D] for the batch's (rows, slots).

        No bounds check here (it would cost a host sync per layer): `check_fits` runs
        once per forward, before the model is called.
        """
        if batch.starts is not None and len(batch.rows) == 1:  # one chain: a plain slice copy
            row, s0, T = batch.rows[0], batch.starts[0], k.shape[2]
            self.k[layer][row, :, s0 : s0 + T] = k[0]
            self.v[layer][row, :, s0 : s0 + T] = v[0]
            return
        rows = batch.row_index[:, None]  # [B, 1] broadcast with slots
        # Advanced indices (rows, slots) around a slice put their dims first: value [B, T, H, D].
        # (.to: under torch.autocast, as in `forerun train --precision bfloat16`, k/v arrive in
        # the autocast dtype; index_put does not convert by itself. A no-op otherwise.)
        self.k[layer][rows, :, batch.slots] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, batch.slots] = v.transpose(1, 2).to(self.v[layer].dtype)

    def check_fits(self, batch: ForwardBatch):
        if batch.kv_len > self.capacity:
            raise IndexError(f"forward reaches slot {batch.kv_len - 1}, KV capacity is {self.capacity}")

    def read(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, S) for the batch's rows: [B, H_kv, S, D] each, widened."""
        idx = self._rows_index(batch)
        return widened(self.k[layer][idx, :, : batch.kv_len]), widened(self.v[layer][idx, :, : batch.kv_len])

    def truncate(self, row: int, length: int):
        """Keep slots [0, length); later writes overwrite the rest. O(1), no copy."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[row] = length

    def export_slots(self, row: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [lo, hi) of `row`, every layer: [layers, H_kv, hi - lo, D] each (a copy)."""
        return torch.stack([k[row, :, lo:hi] for k in self.k]), torch.stack([v[row, :, lo:hi] for v in self.v])

    def import_slots(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [layers, H_kv, n, D] at slots [lo, lo + n) of `row` (export_slots' inverse)."""
        n = k.shape[2]
        for layer, (kl, vl) in enumerate(zip(self.k, self.v)):
            kl[row, :, lo : lo + n].copy_(k[layer])
            vl[row, :, lo : lo + n].copy_(v[layer])

    def import_blocks(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [blocks, layers, H_kv, n, D] at slots [lo, lo + blocks * n) of `row`."""
        nb, _, H, n, D = k.shape
        for layer, (kl, vl) in enumerate(zip(self.k, self.v)):  # [H, nb * n, D] seen as [H, nb, n, D]
            kl[row, :, lo : lo + nb * n].view(H, nb, n, D).copy_(k[:, layer].transpose(0, 1))
            vl[row, :, lo : lo + nb * n].view(H, nb, n, D).copy_(v[:, layer].transpose(0, 1))

    def move(self, row: int, src_slots: list[int], dst_slots: list[int]):
        """Copy entries src -> dst in every layer (token-tree compaction of the accepted path)."""
        src = torch.tensor(src_slots, device=self.k[0].device)
        dst = torch.tensor(dst_slots, device=self.k[0].device)
        for kk, vv in zip(self.k, self.v):
            kk[row, :, dst] = kk[row, :, src]
            vv[row, :, dst] = vv[row, :, src]


def tree_batch(
    new_tokens: list[list[int]], parents: list[list[int]], starts: list[int], rows: list[int], device: torch.device
) -> ForwardBatch:
    """Row b feeds a token tree: node 0 (the pending token) at slot starts[b], node i at
    slot starts[b] + i, RoPE position starts[b] + depth(i). parents[b][i] < i, -1 for node 0.

    Each node sees the committed prefix and its own ancestors, nothing else: a chain gives
    exactly chain_batch's mask. Padding nodes hang off node 0 and nobody sees them.
    >>> b = tree_batch([[9, 1, 2]], [[-1, 0, 0]], [4], [0], torch.device("cpu"))
    >>> b.positions.tolist(), b.mask[0, 0, 2].tolist()
    ([[4, 5, 5]], [True, True, True, True, True, False, True])
    """
    T = max(len(t) for t in new_tokens)
    kv_len = max(starts) + T
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    depth = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, kv_len, dtype=torch.bool)
    for b, (toks, par, s0) in enumerate(zip(new_tokens, parents, starts)):
        par = list(par) + [0] * (T - len(toks))
        toks = list(toks) + [toks[0]] * (T - len(toks))
        tokens[b] = torch.tensor(toks)
        mask[b, :, :s0] = True
        for i in range(T):
            mask[b, i, s0 + i] = True
            if i:
                mask[b, i, s0 : s0 + T] |= mask[b, par[i], s0 : s0 + T]
                depth[b, i] = depth[b, par[i]] + 1
    start = torch.tensor(starts)[:, None]
    slots = start + torch.arange(T)[None, :]
    return ForwardBatch(
        tokens.to(device), (start + depth).to(device), slots.to(device), list(rows), kv_len, mask[:, None].to(device)
    )
