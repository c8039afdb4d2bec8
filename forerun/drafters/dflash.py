"""Block-parallel drafting (heads/dflash.py): one forward of the head over the verifier's
last `context` hidden states and `block` mask positions gives the distributions of the
block tokens after the pending one, none of them conditioned on another drafted token.

That is the shape of Medusa's output ([B, K, V] per step), so drafting and verification are
Medusa's: a chain (greedy argmax per position; sampling, one draw from each position's q,
verified by rejection sampling with that q) or, with `--tree-width` > 1, a tree over each
position's top candidates (drafters/medusa.py explains why both stay exact).
"""
from __future__ import annotations

import torch

from forerun.drafters.base import DraftRequest, register
from forerun.drafters.medusa import MedusaDrafter
from forerun.drafters.tree_select import TreeOptions


class DFlashDrafter(MedusaDrafter):
    name = "dflash"

    def __init__(self, model, head, tree: TreeOptions = TreeOptions(), logits=None):
        self.model, self.heads, self.tree = model, head, tree
        self.logits = logits or model.hidden_to_logits
        self.num_heads = head.config.block  # the longest draft
        self.features = None

    def block_logits(self, live: list[DraftRequest]) -> torch.Tensor:
        """[B, block, V] for the tokens after each row's pending one (at position P = N - 1),
        from the pairs (f_t, x_{t+1}), t = P - context .. P - 1."""
        C, dev = self.heads.config.context, self.features.buf.device
        rows = torch.tensor([r.row for r in live], device=dev)
        ends = torch.tensor([len(r.tokens) - 1 for r in live], device=dev)  # P: pairs end at t = P - 1
        t = ends[:, None] - C + torch.arange(C, device=dev)  # [B, C] oldest first
        valid = t >= 0
        feats = self.features.buf[rows[:, None], t.clamp_min(0)]  # [B, C, H]
        nxt = [r.tokens[max(1, len(r.tokens) - C) :] for r in live]  # x_{t+1} for the valid t (t >= 0)
        toks = torch.zeros(len(live), C, dtype=torch.long, device=dev)
        for b, xs in enumerate(nxt):
            toks[b, C - len(xs) :] = torch.tensor(xs, device=dev)
        embeds = self.model.model.embed_tokens(toks).to(feats.dtype)
        return self.logits(self.heads(feats, embeds, valid))


@register("dflash")
def _make(spec, verifier, **_) -> DFlashDrafter:
    from forerun.drafters.draft_vocab import head_logits
    from forerun.heads.checkpoint import at_verifier_precision, load_head

    head = at_verifier_precision(load_head(spec.draft_model, "dflash", verifier.model), spec, verifier)
    return DFlashDrafter(verifier.model, head, TreeOptions.from_spec(spec), head_logits(spec, verifier))
