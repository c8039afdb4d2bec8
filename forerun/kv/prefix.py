"""Automatic prefix caching: full KV blocks kept after a request, reused by a later one whose
tokens start the same way.

A block is `block_size` consecutive tokens at whole-block positions. Its key is SHA-256 over
its parent's key (the block before it: a key names the whole prefix, not the block alone),
its token ids and a salt (model, precision, KV dtype, and a tenant's `cache_salt`), so equal
keys mean equal K/V: the forwards that computed them are batch-invariant (kernels/backend.py),
so a block computed in turn 1's prefill, in a decoding step or in another request's prompt
holds the same bits as computing it now. A hit always leaves at least the last prompt token
to compute (its forward gives the first logits).

    >>> a = block_keys([1, 2, 3, 4, 5], 2, b"salt")
    >>> len(a), a == block_keys([1, 2, 3, 4, 9], 2, b"salt")  # two whole blocks; the partial one has no key
    (2, True)
    >>> a[1] == block_keys([7, 2, 3, 4], 2, b"salt")[1]  # the second key names the first block too
    False

Eviction: least recently used first, and a block only once no cached block follows it (leaf
first: a chain is dropped from its end, so what stays is always a reachable prefix). Blocks
that the memory bound cannot keep are simply not stored.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import torch


def block_keys(tokens: list[int], block_size: int, salt: bytes) -> list[bytes]:
    """The chained SHA-256 key of every whole block of `tokens`."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(b"|".join(str(t).encode() for t in tokens[start : start + block_size]))
        h.update(b"#" + salt)
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class Block:
    parent: bytes | None
    k: torch.Tensor  # [layers, H_kv, block_size, D]
    v: torch.Tensor
    children: int = 0  # cached blocks whose parent this is
    used: int = 0  # the pool's clock at its last hit or store


@dataclass
class PrefixStats:
    """Tokens asked for (whole blocks of prompts), found, and dropped to make room."""

    queried: int = 0
    hit: int = 0
    evicted: int = 0
    stored: int = 0


@dataclass
class PrefixPool:
    """Cached KV blocks of one model, at most `max_bytes` of K and V."""

    block_size: int
    max_bytes: int
    salt: bytes  # model, precision, KV dtype: a block of another model never matches
    blocks: dict[bytes, Block] = field(default_factory=dict)
    stats: PrefixStats = field(default_factory=PrefixStats)
    used_bytes: int = 0  # K and V of the cached blocks
    _clock: itertools.count = field(default_factory=itertools.count)

    def keys(self, tokens: list[int], salt: bytes = b"") -> list[bytes]:
        return block_keys(tokens, self.block_size, self.salt + b"/" + salt)

    def lookup(self, tokens: list[int], salt: bytes = b"") -> list[Block]:
        """The cached blocks that start `tokens`, in order, leaving its last token uncovered."""
        keys = self.keys(tokens[:-1], salt)
        self.stats.queried += len(keys) * self.block_size
        hits = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            block.used = next(self._clock)
            hits.append(block)
        self.stats.hit += len(hits) * self.block_size
        return hits

    def read(self, tokens: list[int], cache, row: int, salt: bytes = b"") -> int:
        """Copy the cached blocks that start `tokens` into slots [0, n) of a cache row (any
        KVStore); returns n, the tokens they cover (0 on a miss)."""
        return restore(self.lookup(tokens, salt), cache, row)

    def store(self, tokens: list[int], cache, row: int, computed: int, salt: bytes = b"") -> int:
        """Keep the whole blocks of tokens[:computed] whose K/V a cache row holds (any KVStore);
        returns the blocks newly stored."""
        keys = self.keys(tokens[:computed], salt)
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        for key in keys:  # the whole chain is fresh now: evict others before any of it
            if key in self.blocks:
                self.blocks[key].used = next(self._clock)
        if not new:
            return 0
        lo, hi = new[0] * self.block_size, (new[-1] + 1) * self.block_size
        ks, vs = cache.export_slots(row, lo, hi)  # [layers, H_kv, hi - lo, D]
        per_block = (ks.nbytes + vs.nbytes) * self.block_size // (hi - lo)
        stored = 0
        for i in new:
            if not self._make_room(per_block, keep=set(keys[: i + 1])):
                break  # the bound is reached and every block left is this chain's own
            s = (i - new[0]) * self.block_size
            parent = keys[i - 1] if i else None
            if parent is not None and parent not in self.blocks:
                break  # its parent could not be kept: a child without one is never reached
            block = Block(parent, ks[:, :, s : s + self.block_size].clone(), vs[:, :, s : s + self.block_size].clone(),
                          used=next(self._clock))
            self.blocks[keys[i]] = block
            self.used_bytes += block.k.nbytes + block.v.nbytes
            if parent is not None:
                self.blocks[parent].children += 1
            stored += 1
        self.stats.stored += stored * self.block_size
        return stored

    def _make_room(self, nbytes: int, keep: set[bytes]) -> bool:
        """Evict least recently used leaves (never one of `keep`) until `nbytes` fit."""
        while self.used_bytes + nbytes > self.max_bytes:
            leaves = [(b.used, key) for key, b in self.blocks.items() if b.children == 0 and key not in keep]
            if not leaves:
                return False
            _, key = min(leaves)
            block = self.blocks.pop(key)
            if block.parent is not None and block.parent in self.blocks:
                self.blocks[block.parent].children -= 1
            self.used_bytes -= block.k.nbytes + block.v.nbytes
            self.stats.evicted += self.block_size
        return True

    def reset(self) -> int:
        """Drop every cached block; returns how many there were."""
        n = len(self.blocks)
        self.blocks.clear()
        self.used_bytes = 0
        return n


def restore(blocks: list[Block], cache, row: int) -> int:
    """Copy `blocks` (a prefix, in order) into slots [0, n) of a cache row (any KVStore); returns n."""
    if not blocks:
        return 0
    ks, vs = torch.cat([b.k for b in blocks], dim=2), torch.cat([b.v for b in blocks], dim=2)  # [layers, H, n, D]
    cache.import_slots(row, 0, ks, vs)
    return ks.shape[2]
