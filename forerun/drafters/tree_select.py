"""Choosing which candidate tokens form a draft tree, under a node budget (pure functions).

Both trained drafters score a candidate by its path's draft confidence: the product of the
drafter's probabilities along the path (a sum of log-probabilities). A child never scores
above its parent, so the `budget` best nodes always include their ancestors: a tree.
  Medusa: every depth has one fixed list of top-w candidates (head d's), so the tree is
          grown best-first over rank paths (best_first_tree).
  EAGLE-2: candidates depend on their parents; the drafter expands the most confident
          frontier nodes depth by depth, then keeps the best nodes overall (top_nodes).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from forerun.errors import ConfigError


@dataclass(frozen=True)
class TreeOptions:
    """How wide and how big a trained drafter's tree is (width 1: a chain, no tree).

    width: candidates per node (top-w of the drafter's distribution), SpeculativeConfig.tree_width;
    nodes: most draft tokens per tree, options["tree_nodes"];
    beam:  EAGLE-2 only: frontier nodes expanded per depth, options["tree_beam"].
    """

    width: int = 1
    nodes: int = 16
    beam: int = 4

    def __post_init__(self):
        if self.width < 1 or self.nodes < 1 or self.beam < 1:
            raise ConfigError(f"tree width, nodes and beam must be >= 1, got {self}")

    @classmethod
    def from_spec(cls, spec) -> "TreeOptions":
        o = spec.options
        return cls(spec.tree_width, int(o.get("tree_nodes", cls.nodes)), int(o.get("tree_beam", cls.beam)))

    @property
    def is_tree(self) -> bool:
        return self.width > 1


@dataclass
class RankTree:
    parents: list[int]  # [n] parent node, -1 = the pending token; parents come first
    depth: list[int]  # [n] 0-based depth (= which head / list the node's token comes from)
    rank: list[int]  # [n] index of the node's token in its depth's candidate list


def best_first_tree(logp: list[list[float]], budget: int) -> RankTree:
    """The `budget` most confident nodes when depth d offers the candidates logp[d] (sorted,
    best first) below every node of depth d - 1. Nodes come out best first.

    >>> t = best_first_tree([[-0.1, -2.0], [-0.5, -0.7]], 3)
    >>> t.parents, t.depth, t.rank
    ([-1, 0, 0], [0, 1, 1], [0, 0, 1])
    """
    tree = RankTree([], [], [])
    heap = [(-s, 0, r, -1) for r, s in enumerate(logp[0]) if s > -math.inf] if logp else []
    heapq.heapify(heap)
    while heap and len(tree.parents) < budget:
        neg, d, r, parent = heapq.heappop(heap)
        node = len(tree.parents)
        tree.parents.append(parent)
        tree.depth.append(d)
        tree.rank.append(r)
        if d + 1 < len(logp):
            for r2, s in enumerate(logp[d + 1]):
                if s > -math.inf:
                    heapq.heappush(heap, (neg - s, d + 1, r2, node))
    return tree


def top_nodes(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """Indices of the `budget` highest-scoring nodes, in their original order, where
    scores[i] <= scores[parents[i]] and parents[i] < i: ties keep the earlier node, so every
    kept node's ancestors are kept.

    >>> top_nodes([-0.1, -0.2, -0.3, -0.15], [-1, -1, 0, 0], 3)
    [0, 1, 3]
    """
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:budget]
    return sorted(order)


def reindex(parents: list[int], kept: list[int]) -> list[int]:
    """Parents of the kept nodes (sorted, closed under ancestors) renumbered among themselves.

    >>> reindex([-1, -1, 0, 0], [0, 1, 3])
    [-1, -1, 0]
    """
    new = {old: i for i, old in enumerate(kept)}
    return [new[parents[i]] if parents[i] >= 0 else -1 for i in kept]
