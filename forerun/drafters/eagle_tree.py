"""EAGLE-2 dynamic draft trees (Li et al. 2024b) on top of the EAGLE head.

Per row, from the head's guess f^_{N-1} after catch-up:
  1. expand the root: its top-w tokens become depth-1 nodes, scored by log q;
  2. for depth d = 1 .. D - 1: feed the `beam` best depth-d nodes to the head in one
     forward (each a pair (its parent's output, its token) at position N - 2 + d, seeing the
     committed pairs and its fed ancestors: a tree mask over the head's cache), and expand
     each into its top-w children, scored by the path's summed log q (its confidence);
  3. rerank: keep the `nodes` best nodes of all (tree_select.top_nodes, closed under
     ancestors) and send them as a deterministic tree (probs=None).
Scores are the head's softmax at temperature 1, for greedy and sampled requests alike;
the tree is a function of the committed prefix only, so the one-hot sibling rule keeps
sampling exact. Fed nodes use slots N - 1, N, ... of the head's cache, stale afterwards
(the next catch-up rewrites from N - 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forerun.drafters.base import Draft, DraftRequest
from forerun.drafters.tree_select import reindex, top_nodes
from forerun.kv.cache import ForwardBatch


@dataclass
class CandidateTree:
    base: int  # N - 1: the pending position, where depth-1 pairs sit and fed slots start
    tokens: list[int] = field(default_factory=list)  # [n] candidate tokens
    parents: list[int] = field(default_factory=list)  # [n] -1 = the pending token
    depth: list[int] = field(default_factory=list)  # [n] 1-based
    scores: list[float] = field(default_factory=list)  # [n] summed log q of the path
    source: list[torch.Tensor] = field(default_factory=list)  # [n] x [H] the guess that predicted the node
    seen: dict[int, list[int]] = field(default_factory=dict)  # fed node -> slots of its fed ancestors and itself
    fed: int = 0  # nodes fed so far (slots base .. base + fed - 1)


def grow(drafter, live: list[DraftRequest], guess: torch.Tensor, depths: list[int]) -> list[Draft]:
    """One EAGLE-2 tree per live row; guess [B, H] is each row's f^_{N-1}; depths[b] <= k."""
    drafts = []
    for t in candidates(drafter, live, guess, depths):
        kept = top_nodes(t.scores, t.parents, drafter.tree.nodes)
        drafts.append(Draft([t.tokens[i] for i in kept], None, reindex(t.parents, kept)))
    return drafts


def candidates(drafter, live: list[DraftRequest], guess: torch.Tensor, depths: list[int]) -> list[CandidateTree]:
    """Steps 1 and 2: every row's scored candidates, before the rerank."""
    trees = [CandidateTree(len(r.tokens) - 1) for r in live]
    _expand(drafter, trees, [[-1] for _ in live], guess[:, None])
    for d in range(1, max(depths)):
        picks = [_frontier(t, d, drafter.tree.beam) if depths[b] > d else [] for b, t in enumerate(trees)]
        if not any(picks):
            break
        out = _feed(drafter, trees, picks, [r.row for r in live])  # [B, T, H]
        _expand(drafter, trees, picks, out)
    return trees


def _frontier(t: CandidateTree, depth: int, beam: int) -> list[int]:
    nodes = [i for i, d in enumerate(t.depth) if d == depth]
    return sorted(nodes, key=lambda i: (-t.scores[i], i))[:beam]


def _expand(drafter, trees: list[CandidateTree], parents: list[list[int]], feats: torch.Tensor) -> None:
    """Children for node parents[b][i] (-1: the root) from the head's output feats[b, i]."""
    logp = torch.log_softmax(drafter.logits(feats).float(), dim=-1)  # [B, T, V]
    top = logp.topk(min(drafter.tree.width, logp.shape[-1]), dim=-1)
    vals, ids = top.values.tolist(), top.indices.tolist()
    for b, t in enumerate(trees):
        for i, p in enumerate(parents[b]):
            for s, tok in zip(vals[b][i], ids[b][i]):
                t.tokens.append(tok)
                t.parents.append(p)
                t.depth.append(t.depth[p] + 1 if p >= 0 else 1)
                t.scores.append((t.scores[p] if p >= 0 else 0.0) + s)
                t.source.append(feats[b, i])


def _feed(drafter, trees: list[CandidateTree], picks: list[list[int]], rows: list[int]) -> torch.Tensor:
    """Run the picked nodes through the head (a tree mask per row); [B, T, H] their outputs.
    Rows with fewer picks are padded with nodes that see only the committed pairs."""
    B, T = len(trees), max(len(p) for p in picks)
    kv_len = max(t.base + t.fed for t in trees) + T
    H = trees[0].source[0].shape[-1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    slots = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, kv_len, dtype=torch.bool)
    feats = trees[0].source[0].new_zeros(B, T, H)
    for b, (t, pick) in enumerate(zip(trees, picks)):
        for i in range(T):
            slot = t.base + t.fed + i
            slots[b, i], positions[b, i] = slot, t.base
            mask[b, i, : t.base] = True
            if i < len(pick):
                n, p = pick[i], t.parents[pick[i]]
                t.seen[n] = (t.seen[p] if p >= 0 else []) + [slot]
                mask[b, i, t.seen[n]] = True
                tokens[b, i], positions[b, i], feats[b, i] = t.tokens[n], t.base + t.depth[n] - 1, t.source[n]
            else:
                mask[b, i, slot] = True
        t.fed += len(pick)
    dev = drafter.model.device
    batch = ForwardBatch(tokens.to(dev), positions.to(dev), slots.to(dev), list(rows), kv_len, mask[:, None].to(dev))
    return drafter.run(feats, batch.tokens, batch)
