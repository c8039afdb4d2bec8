"""Automatic prefix caching: a request's KV blocks kept after it (whole ones, and its last partial
one), reused by a later request whose tokens start the same way.

A block is `block_size` consecutive tokens at whole-block positions. Its key is SHA-256 over
its parent's key (the block before it: a key names the whole prefix, not the block alone),
its token ids and a salt (model, precision, KV dtype, and a tenant's `cache_salt`), so equal
keys mean equal K/V: the forwards that computed them are batch-invariant (kernels/backend.py),
so a block computed in turn 1's prefill, in a decoding step or in another request's prompt
holds the same bits as computing it now. A hit always leaves at least the last prompt token
to compute (its forward gives the first logits).

Hits are token-granular at their end, as llama-server's prompt cache and SGLang's radix tree
are: a request's last, partial block is kept too (a tail, keyed by its parent and its tokens),
and after the whole blocks a prompt reads the longest run of tokens it shares with any cached
child of its last hit (a tail, or a whole block it leaves part way). The K/V of a position
depend only on the tokens up to it, so those first tokens' K/V are the prompt's own. An agent's
next turn resends the last answer: it then reads all of it, not the answer's whole blocks only.

    >>> a = block_keys([1, 2, 3, 4, 5], 2, b"salt")
    >>> len(a), a == block_keys([1, 2, 3, 4, 9], 2, b"salt")  # two whole blocks; the partial one has no key
    (2, True)
    >>> a[1] == block_keys([7, 2, 3, 4], 2, b"salt")[1]  # the second key names the first block too
    False

Eviction: least recently used first, and a block only once no cached block follows it (leaf
first: a chain is dropped from its end, so what stays is always a reachable prefix). Blocks
that the memory bound cannot keep are simply not stored.

Drafters that read the verifier's hidden states (Medusa, EAGLE, DFlash heads) need those of the
cached positions too: their blocks also keep the hidden state of every position (`hidden` to
`store`, `on_hidden` to `read`), under keys of their own (a block stored without them is never
read for such a drafter, and a plain request never pays for them).
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch


def _token_bytes(tokens) -> bytes:
    """Token ids as a key hashes them: decimal, '|' between."""
    return b"|".join(str(t).encode() for t in tokens)


def block_keys(tokens: list[int], block_size: int, salt: bytes) -> list[bytes]:
    """The chained SHA-256 key of every whole block of `tokens`."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(_token_bytes(tokens[start : start + block_size]))
        h.update(b"#" + salt)
        parent = h.digest()
        keys.append(parent)
    return keys


def tail_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a partial block (fewer than block_size tokens) after the block `parent`: never
    equal to a whole block's key (another text is hashed), so a whole-block lookup never finds it."""
    h = hashlib.sha256(b"tail|" + parent)
    h.update(_token_bytes(tokens))
    return h.digest()


@dataclass
class Block:
    parent: bytes | None
    tokens: tuple[int, ...]  # block_size token ids, fewer for a tail
    k: torch.Tensor  # [layers, H_kv, len(tokens), D]
    v: torch.Tensor
    h: torch.Tensor | None = None  # [len(tokens), hidden]: the verifier's hidden states there (see above)
    children: int = 0  # cached blocks (whole or tails) whose parent this is
    used: int = 0  # the pool's clock at its last hit or store


@dataclass
class Match:
    """What the cache holds of a prompt: whole blocks, then the first `tail_len` tokens of one
    more cached block (a tail, or a whole block the prompt leaves part way)."""

    blocks: list[Block]
    tail: Block | None = None
    tail_len: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks) + self.tail_len


@dataclass
class PrefixStats:
    """Prompt tokens asked for (all but each prompt's last), found, and dropped to make room."""

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
    used_bytes: int = 0  # K and V (and hidden states) of the cached blocks
    kids: dict[bytes, set[bytes]] = field(default_factory=dict)  # a block's key -> its cached children's
    _clock: itertools.count = field(default_factory=itertools.count)

    def keys(self, tokens: list[int], salt: bytes = b"", hidden: bool = False) -> list[bytes]:
        return block_keys(tokens, self.block_size, self.salt + (b"/hidden/" if hidden else b"/") + salt)

    def lookup(self, tokens: list[int], salt: bytes = b"", hidden: bool = False) -> Match:
        """The cached K/V that start `tokens`, leaving its last token uncovered: whole blocks in
        order, then the cached child of the last one that shares the most next tokens (hidden:
        among the blocks that keep hidden states)."""
        keys = self.keys(tokens[:-1], salt, hidden)
        self.stats.queried += len(tokens) - 1
        hits = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            block.used = next(self._clock)
            hits.append(block)
        match = Match(hits)
        n = len(hits) * self.block_size
        if hits and len(tokens) - 1 > n:
            want = tuple(tokens[n : min(n + self.block_size, len(tokens) - 1)])
            for key in self.kids.get(keys[len(hits) - 1], ()):
                block = self.blocks[key]
                m = _shared(block.tokens, want)
                if m > match.tail_len:
                    match.tail, match.tail_len = block, m
            if match.tail is not None:
                match.tail.used = next(self._clock)
        self.stats.hit += match.tokens
        return match

    def read(self, tokens: list[int], cache, row: int, salt: bytes = b"",
             on_hidden: Callable[[torch.Tensor], None] | None = None) -> int:
        """Copy the cached K/V that start `tokens` into slots [0, n) of a cache row (any
        KVStore); returns n, the tokens they cover (0 on a miss). on_hidden: read the blocks
        that keep hidden states, and hand it those of positions [0, n) ([n, hidden]) on a hit."""
        match = self.lookup(tokens, salt, hidden=on_hidden is not None)
        n = restore(match, cache, row)
        if n and on_hidden is not None:
            on_hidden(torch.cat([b.h for b in match.blocks] + ([match.tail.h[: match.tail_len]] if match.tail_len else [])))
        return n

    def store(self, tokens: list[int], cache, row: int, computed: int, salt: bytes = b"",
              hidden: torch.Tensor | None = None) -> int:
        """Keep the blocks of tokens[:computed] whose K/V a cache row holds (any KVStore): the
        whole ones, then the partial one after them as a tail; returns the blocks newly stored.
        hidden [>= computed, hidden_size]: the verifier's hidden states of those positions, kept
        with them (under the keys `read(on_hidden=...)` looks up)."""
        keys = self.keys(tokens[:computed], salt, hidden is not None)
        h = (lambda a, b: None) if hidden is None else (lambda a, b: hidden[a:b])
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        for key in keys:  # the whole chain is fresh now: evict others before any of it
            if key in self.blocks:
                self.blocks[key].used = next(self._clock)
        stored, tokens_kept = 0, 0
        if new:
            lo, hi = new[0] * self.block_size, (new[-1] + 1) * self.block_size
            ks, vs = cache.export_slots(row, lo, hi)  # [layers, H_kv, hi - lo, D]
            for i in new:
                s = (i - new[0]) * self.block_size
                parent = keys[i - 1] if i else None
                if not self._keep(keys[i], parent, tuple(tokens[lo + s : lo + s + self.block_size]),
                                  ks[:, :, s : s + self.block_size], vs[:, :, s : s + self.block_size], set(keys[: i + 1]),
                                  h(lo + s, lo + s + self.block_size)):
                    break  # no room, or its parent could not be kept (a child without one is never reached)
                stored, tokens_kept = stored + 1, tokens_kept + self.block_size
        whole = len(keys) * self.block_size
        if keys and computed > whole and keys[-1] in self.blocks:
            tail = tuple(tokens[whole:computed])
            key = tail_key(keys[-1], tail)
            covering = [o for o in self.kids.get(keys[-1], ()) if _shared(self.blocks[o].tokens, tail) == len(tail)]
            if covering:  # this tail itself, a longer one or a whole block holds these K/V already
                self.blocks[covering[0]].used = next(self._clock)
            else:
                ks, vs = cache.export_slots(row, whole, computed)
                if self._keep(key, keys[-1], tail, ks, vs, set(keys) | {key}, h(whole, computed)):
                    stored, tokens_kept = stored + 1, tokens_kept + len(tail)
        self.stats.stored += tokens_kept
        return stored

    def _keep(self, key: bytes, parent: bytes | None, tokens: tuple[int, ...], k: torch.Tensor, v: torch.Tensor,
              keep: set[bytes], h: torch.Tensor | None = None) -> bool:
        """Store one block (k, v [layers, H_kv, len(tokens), D], and h [len(tokens), hidden] where
        given, copied) under `parent`; a cached tail that it continues is dropped (this block
        holds its K/V too). False when the bound leaves no room or the parent is not cached."""
        nbytes = _nbytes(k, v, h)
        if not self._make_room(nbytes, keep) or (parent is not None and parent not in self.blocks):
            return False
        if parent is not None:
            held = [o for o in self.kids.get(parent, ()) if _shared(self.blocks[o].tokens, tokens) == len(self.blocks[o].tokens)]
            for other in held:  # tails this block continues
                self._drop(other)
            self.blocks[parent].children += 1
            self.kids.setdefault(parent, set()).add(key)
        self.blocks[key] = Block(parent, tokens, k.clone(), v.clone(), None if h is None else h.clone(), used=next(self._clock))
        self.used_bytes += nbytes
        return True

    def _make_room(self, nbytes: int, keep: set[bytes]) -> bool:
        """Evict least recently used leaves (never one of `keep`) until `nbytes` fit."""
        while self.used_bytes + nbytes > self.max_bytes:
            leaves = [(b.used, key) for key, b in self.blocks.items() if b.children == 0 and key not in keep]
            if not leaves:
                return False
            _, key = min(leaves)
            self.stats.evicted += len(self.blocks[key].tokens)
            self._drop(key)
        return True

    def _drop(self, key: bytes) -> None:
        """Remove a leaf block."""
        block = self.blocks.pop(key)
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children -= 1
            self.kids[block.parent].discard(key)
        self.kids.pop(key, None)
        self.used_bytes -= _nbytes(block.k, block.v, block.h)

    def reset(self) -> int:
        """Drop every cached block; returns how many there were."""
        n = len(self.blocks)
        self.blocks.clear()
        self.kids.clear()
        self.used_bytes = 0
        return n


STAGE_BYTES = 8 << 20  # K and V of the blocks one import_blocks call copies (restore)


def _nbytes(k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None) -> int:
    return k.nbytes + v.nbytes + (0 if h is None else h.nbytes)


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many first tokens a and b share.

    >>> _shared((1, 2, 3), (1, 2, 4, 5)), _shared((1,), (2,))
    (2, 0)
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def restore(match: Match, cache, row: int) -> int:
    """Copy a lookup's K/V into slots [0, n) of a cache row (any KVStore); returns n."""
    if not match.blocks:
        return 0
    blocks, n = match.blocks, 0
    # [blocks, layers, H_kv, block_size, D]: whole blocks stacked (a contiguous copy each), about
    # STAGE_BYTES at a time: a staging buffer that small is reused by the allocator, where one for a
    # whole 2k-token prefix is fresh memory every time (its page faults cost more than the copies).
    per = max(1, STAGE_BYTES // (blocks[0].k.nbytes + blocks[0].v.nbytes))
    for i in range(0, len(blocks), per):
        run = blocks[i : i + per]
        cache.import_blocks(row, n, torch.stack([b.k for b in run]), torch.stack([b.v for b in run]))
        n += sum(len(b.tokens) for b in run)
    if match.tail_len:
        m = match.tail_len
        cache.import_slots(row, n, match.tail.k[:, :, :m], match.tail.v[:, :, :m])
    return n + match.tail_len
