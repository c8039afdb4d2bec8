"""Suffix decoding's candidate trees (SuffixDecoding, Oliaro et al., NeurIPS 2025), as pure
functions over token arrays.

A suffix tree answers one question per step: "the last n tokens of this sequence, where
did they occur before, and what followed, how often?". The same answer comes from scanning
the text for the occurrences (numpy, vectorised: what prompt lookup does in ngram.py), which
needs no tree to build, update or evict, so forerun scans:

    haystack  ... a b c x y ... a b c x z ... a b c x y ...      (-1 separates texts)
    pattern   the sequence's last tokens  "a b c"  (longest match n = 3, three occurrences)
    counts    x: 3, then x y: 2, x z: 1   -> p(x) = 1, p(x y) = 2/3, p(x z) = 1/3

The draft is the token tree of the most frequent continuations, grown best-first by that
empirical probability: a node goes in while its probability is at least `min_prob`, up to
`factor * n` nodes (SuffixDecoding's rule: a longer match earns a longer draft) and the
engine's budget. Its score, the sum of the nodes' probabilities, is the expected number
of tokens the verifier accepts if the counts are right; the caller keeps the best-scoring
tree over match lengths and over the texts it searched (this request, earlier requests).
Every proposal is deterministic (one-hot q), so verification is exact.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from forerun.drafters.ngram import pattern_ends

SEP = -1  # between texts in a haystack: no token equals it, so no match or continuation crosses it


@dataclass(frozen=True)
class SuffixRule:
    max_match: int = 24  # longest pattern looked up (SuffixDecoding's tree depth)
    factor: float = 1.0  # draft nodes allowed per matched token
    min_prob: float = 0.1  # a node's empirical probability must reach this
    max_occurrences: int = 64  # the most recent occurrences of a match counted


@dataclass
class Candidate:
    tokens: list[int]  # [n] node tokens, parents before children
    parents: list[int]  # [n] parent node index, -1 = the pending token
    score: float  # sum of the nodes' empirical probabilities (expected accepted tokens)
    match_len: int  # pattern length the tree grew from

    @classmethod
    def empty(cls) -> "Candidate":
        return cls([], [], 0.0, 0)


def continuations(hay: np.ndarray, ends: np.ndarray, depth: int) -> list[list[int]]:
    """What followed each end, at most `depth` tokens, cut at a separator or the hay's end.

    >>> continuations(np.array([1, 2, 3, -1, 2, 4]), np.array([1, 4]), 3)
    [[3], [4]]
    """
    out = []
    for e in ends.tolist():
        cont = hay[e + 1 : e + 1 + depth]
        cut = np.flatnonzero(cont == SEP)
        out.append(cont[: cut[0] if cut.size else len(cont)].tolist())
    return out


def grow_tree(conts: list[list[int]], max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """The best-first token tree over the continuations: (tokens, parents, score).

    A node's probability is the share of continuations through it; a child is never more
    likely than its parent, so taking nodes in descending probability keeps every parent
    in before its children.
    >>> grow_tree([[5, 6], [5, 6], [5, 7]], 3, 0.1)
    ([5, 6, 7], [-1, 0, 0], 2.0)
    >>> grow_tree([[5, 6], [5, 6], [5, 7]], 2, 0.5)
    ([5, 6], [-1, 0], 1.6666666666666667)
    """
    total = len([c for c in conts if c])
    if not total or max_nodes <= 0:
        return [], [], 0.0
    counts: dict[tuple[int, ...], int] = {}
    for c in conts:
        for d in range(1, len(c) + 1):
            counts[tuple(c[:d])] = counts.get(tuple(c[:d]), 0) + 1
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in counts:
        children.setdefault(path[:-1], []).append(path)
    tokens, parents, index, taken = [], [], {(): -1}, 0
    heap = [(-counts[p], len(p), p) for p in children.get((), [])]
    heapq.heapify(heap)
    while heap and len(tokens) < max_nodes:
        neg, _, path = heapq.heappop(heap)
        if -neg / total < min_prob:
            break
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        taken += -neg
        for child in children.get(path, []):
            heapq.heappush(heap, (-counts[child], len(child), child))
    return tokens, parents, taken / total


def best_candidate(hay: np.ndarray, pattern: np.ndarray, budget: int, rule: SuffixRule,
                   search_end: int | None = None) -> Candidate:
    """The best-scoring tree over match lengths of `pattern`'s tail in `hay`, at most
    `budget` nodes; matches end before `search_end` (a sequence searching itself passes
    its own length - 1, so its tail never matches itself), continuations run to the hay's
    end. Lengths with the same occurrences as a longer one are skipped (the longer match
    sees the same counts and earns at least as many nodes).

    >>> hay = np.array([1, 2, 3, 4, 9, 2, 3, 4, 9, 7, 3, 4, 8])
    >>> c = best_candidate(hay, np.array([2, 3, 4]), 4, SuffixRule())
    >>> c.tokens, c.parents, c.match_len
    ([9, 2, 7], [-1, 0, 0], 3)
    """
    if budget <= 0 or not len(pattern) or not len(hay):
        return Candidate.empty()
    levels = pattern_ends(hay[:search_end], pattern, rule.max_match)
    best, seen = Candidate.empty(), -1
    for n in range(len(levels), 0, -1):
        ends = levels[n - 1]
        if ends.size == seen:  # the same occurrences as the longer match just tried
            continue
        seen = ends.size
        nodes = min(budget, math.ceil(rule.factor * n))
        recent = ends[-rule.max_occurrences :]
        tokens, parents, score = grow_tree(continuations(hay, recent, nodes), nodes, rule.min_prob)
        if score > best.score:
            best = Candidate(tokens, parents, score, n)
    return best
