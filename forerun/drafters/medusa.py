"""Medusa drafting: K heads read the verifier's hidden state at the token before the pending
one and guess the K tokens after the pending one, all at once (heads/medusa.py).

Per row and step, with depth = min(k, K):
  width 1 (a chain): greedy, each head's argmax; sampling, one draw from each head's q
          (logits_to_probs with the request's SamplingParams), verified by rejection sampling.
  width w > 1 (a tree): the `nodes` most confident rank paths over the heads' top-w
          candidates (tree_select.best_first_tree). Greedy: those tokens, a deterministic
          tree (probs=None). Sampling: the same shape, but every node's token is an
          independent draw from its depth's q, so siblings are i.i.d. draws from one q and
          recursive rejection sampling keeps the output exact (Draft's docstring).
The heads read no drafted token, so one forward of K small blocks + the LM head drafts a
whole tree; its quality depends on training (forerun train --method medusa).
"""
from __future__ import annotations

import torch

from forerun.config import SamplingParams
from forerun.drafters.base import Draft, DraftRequest, register
from forerun.drafters.draft_vocab import for_rows
from forerun.drafters.features import ReadsHidden
from forerun.drafters.tree_select import TreeOptions, best_first_tree
from forerun.kv.cache import KVCache
from forerun.sampling import logits_to_probs, sample, sample_many


class MedusaDrafter(ReadsHidden):
    name = "medusa"

    def __init__(self, model, heads, tree: TreeOptions = TreeOptions(), logits=None):
        self.model, self.heads, self.tree = model, heads, tree
        self.logits = logits or model.hidden_to_logits  # hidden [..., H] -> [..., V] (see draft_vocab.head_logits)
        self.num_heads = heads.config.num_heads

    def max_draft_nodes(self, k: int) -> int:
        return self.tree.nodes if self.tree.is_tree else min(k, self.num_heads)

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        self.start_features(num_rows, capacity)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], params: SamplingParams, generator) -> list[Draft]:
        live = [r for r in requests if r.k > 0 and len(r.tokens) > 1 and self.features.covers(r.row, len(r.tokens) - 1)]
        if not live:
            return [Draft([]) for _ in requests]
        for_rows(self.logits, live)  # a reduced head (draft_vocab) then also scores their context ids
        logits = self.block_logits(live)  # [B, K, V]
        make = self._tree if self.tree.is_tree else self._chain
        drafts = dict(zip((r.row for r in live), make(logits, [min(r.k, self.num_heads) for r in live], params, generator)))
        return [drafts.get(r.row, Draft([])) for r in requests]

    def block_logits(self, live: list[DraftRequest]) -> torch.Tensor:
        """[B, K, V]: the heads' distributions over the K tokens after each live row's pending one."""
        h = self.features.at([r.row for r in live], [len(r.tokens) - 2 for r in live])  # [B, H]
        return self.logits(self.heads(h))

    @staticmethod
    def _chain(logits: torch.Tensor, depths: list[int], params: SamplingParams, generator) -> list[Draft]:
        B, K, V = logits.shape
        if params.greedy:
            best = logits.argmax(-1).tolist()  # [B, K]
            return [Draft(best[b][:d]) for b, d in enumerate(depths)]
        q = logits_to_probs(logits, params)  # [B, K, V]
        toks = sample(q.view(B * K, V), generator).view(B, K).tolist()
        return [Draft(toks[b][:d], q[b, :d]) for b, d in enumerate(depths)]

    def _tree(self, logits: torch.Tensor, depths: list[int], params: SamplingParams, generator) -> list[Draft]:
        B, K, V = logits.shape
        q = None if params.greedy else logits_to_probs(logits, params)  # [B, K, V]
        logp = torch.log_softmax(logits.float(), -1) if q is None else q.log()
        top = logp.topk(min(self.tree.width, V), dim=-1)
        vals, ids = top.values.tolist(), top.indices.tolist()  # [B, K, w]
        if q is not None:  # `nodes` independent draws per (row, head): node j of depth d takes its own column
            draws = sample_many(q.view(B * K, V), self.tree.nodes, generator)
            draws = draws.view(B, K, -1).tolist()
        out = []
        for b, d in enumerate(depths):
            t = best_first_tree(vals[b][:d], self.tree.nodes)
            if q is None:
                out.append(Draft([ids[b][dd][r] for dd, r in zip(t.depth, t.rank)], None, t.parents))
                continue
            used = [0] * K
            toks = []
            for dd in t.depth:
                toks.append(draws[b][dd][used[dd]])
                used[dd] += 1
            out.append(Draft(toks, q[b, t.depth], t.parents))
        return out


@register("medusa")
def _make(spec, verifier, **_) -> MedusaDrafter:
    from forerun.drafters.draft_vocab import head_logits
    from forerun.heads.checkpoint import at_verifier_precision, load_head

    heads = at_verifier_precision(load_head(spec.draft_model, "medusa", verifier.model), spec, verifier)
    return MedusaDrafter(verifier.model, heads, TreeOptions.from_spec(spec), head_logits(spec, verifier))
