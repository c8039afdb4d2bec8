"""Prompt-lookup decoding (Saxena 2023): propose what followed the last n tokens before.

No model, no probabilities: every proposal is deterministic (a one-hot q), so the
verifier accepts token x with probability p(x) and a rejection resamples from p
with x removed (verify.rejection_verify).
"""
from __future__ import annotations

import numpy as np

from forerun.drafters.base import Draft, DraftRequest, register
from forerun.kv.cache import KVCache


def match_ends(arr: np.ndarray, n_max: int) -> list[np.ndarray]:
    """levels[n - 1]: the ends e of the earlier matches of arr's last n tokens (the window
    arr[e - n + 1 .. e]), ascending, for n = 1, 2, ... up to n_max or the first n without
    one. Every e <= len - 2, so a continuation always exists and the suffix never matches
    itself. The last token's matches are found in one scan of the context; each longer n
    only narrows the previous n's by one token further back.
    >>> [e.tolist() for e in match_ends(np.array([1, 2, 3, 9, 1, 2]), 3)]
    [[1], [1]]
    """
    return pattern_ends(arr[:-1], arr, n_max)


def pattern_ends(hay: np.ndarray, pattern: np.ndarray, n_max: int) -> list[np.ndarray]:
    """levels[n - 1]: ends e (ascending) of the windows hay[e - n + 1 .. e] equal to the
    pattern's last n tokens, for n = 1, 2, ... up to n_max or the first n without one.

    >>> [e.tolist() for e in pattern_ends(np.array([1, 2, 3, -1, 2, 3, 7]), np.array([9, 2, 3]), 3)]
    [[2, 5], [2, 5]]
    """
    ends, levels = np.flatnonzero(hay == pattern[-1]), []
    for n in range(1, min(n_max, len(pattern)) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[hay[ends - (n - 1)] == pattern[-n]]
        if not ends.size:
            break
        levels.append(ends)
    return levels


def find_continuation(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Match the last n tokens (n from n_max down to n_min) earlier in `tokens`; return
    up to k tokens that followed the most recent match, or [] when nothing matches.

    >>> find_continuation([1, 2, 3, 9, 1, 2], n_max=2, n_min=1, k=3)
    [3, 9, 1]
    >>> find_continuation([1, 2, 3], n_max=2, n_min=1, k=3)
    []
    """
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    levels = match_ends(arr, n_max)  # the longest n with a match is the last level
    if len(levels) < max(n_min, 1):
        return []
    start = int(levels[-1][-1]) + 1
    return arr[start : start + k].tolist()


def find_continuations(tokens: list[int], n_max: int, n_min: int, k: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations: longest n first, most recent match first.

    >>> find_continuations([1, 2, 3, 1, 2, 4, 1, 2], 2, 1, 2, 3)
    [[4, 1], [3, 1]]
    """
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    levels = match_ends(arr, n_max)
    found: list[list[int]] = []
    for n in range(len(levels), max(n_min, 1) - 1, -1):
        for e in levels[n - 1][::-1]:
            cont = arr[e + 1 : e + 1 + k].tolist()
            if cont not in found:
                found.append(cont)
            if len(found) == branches:
                return found
    return found


def trie(continuations: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merge continuations into a token tree (tokens, parents); siblings are distinct.

    >>> trie([[4, 1], [3, 1], [4, 2]])
    ([4, 1, 3, 1, 2], [-1, 0, -1, 2, 0])
    """
    tokens, parents, index = [], [], {}
    for cont in continuations:
        parent = -1
        for tok in cont:
            key = (parent, tok)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = index[key]
    return tokens, parents


class NgramDrafter:
    name = "ngram"
    drafts_after_forced = True  # drafts from the tokens alone: it may continue a grammar's forced run

    def __init__(self, n_max: int = 4, n_min: int = 1, branches: int = 1):
        self.n_max, self.n_min, self.branches = n_max, n_min, branches

    def max_draft_nodes(self, k: int) -> int:
        return k * self.branches

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        pass  # stateless: every proposal is recomputed from the committed tokens

    def propose(self, requests: list[DraftRequest], params, generator) -> list[Draft]:
        if self.branches == 1:
            return [Draft(find_continuation(r.tokens, self.n_max, self.n_min, r.k)) for r in requests]
        out = []
        for r in requests:
            tokens, parents = trie(find_continuations(r.tokens, self.n_max, self.n_min, r.k, self.branches))
            out.append(Draft(tokens, None, parents))  # deterministic siblings: one-hot rule
        return out


@register("ngram")
def _make(spec, **_) -> NgramDrafter:
    return NgramDrafter(spec.ngram_max, spec.ngram_min, spec.ngram_branches)
