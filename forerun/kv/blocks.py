"""KV memory in fixed-size blocks: an allocator and one block table per sequence.

The scheduler admits a sequence only when blocks for its prompt are free, grows its table
before every step to cover the tokens that step may write (pending + draft), preempts the
newest sequence when the pool is out, and returns every block when a sequence leaves
(finished, failed, cancelled or preempted). `BlockAllocator.used` is what the leak tests and
/metrics read.

What the blocks are backed by: with the paged cache (kv/paged.py, the server's default) block
b is block b of the K/V pool, and the kernels read a row's slots through its table; with
rows (`--no-paged`) the tables are accounting only, and block j of the sequence in row r is
slots [j * block_size, (j + 1) * block_size) of row r.
>>> pool = BlockAllocator(num_blocks=4, block_size=16)
>>> t = BlockTable(pool)
>>> t.ensure(17), t.blocks, pool.free
(True, [0, 1], 2)
>>> t.ensure(100), t.blocks
(False, [0, 1])
>>> t.release(); pool.used
0
"""
from __future__ import annotations

import threading


class BlockAllocator:
    """A free list of block ids [0, num_blocks). Thread-safe (the HTTP side reads counts)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, or None (and nothing taken) when fewer than n are free."""
        with self._lock:
            if n > len(self._free):
                return None
            return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(blocks))


class BlockTable:
    """The blocks one sequence holds, in position order: position p lives in
    blocks[p // block_size] at offset p % block_size."""

    def __init__(self, pool: BlockAllocator):
        self.pool, self.blocks = pool, []

    def ensure(self, tokens: int) -> bool:
        """Hold enough blocks for `tokens` positions; False (nothing taken) if the pool is short."""
        need = self.pool.blocks_for(tokens) - len(self.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        self.blocks.extend(got)
        return True

    def release(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []
