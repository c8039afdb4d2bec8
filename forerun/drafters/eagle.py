"""EAGLE drafting: a one-layer head runs one step ahead of the verifier's hidden states
(heads/eagle.py) and drafts autoregressively from its own guesses.

Per row, with N = len(tokens) (the pending token x_{N-1} at position N - 1) and the
verifier's hidden states f_0 .. f_{N-2} in the FeatureStore:
  catch-up:  pairs (f_j, x_{j+1}) for j = synced .. N - 2 go through the head in one
             forward (K/V into the head's own cache at slots j), ending in f^_{N-1};
             pairs are rewritten from the first position whose true f_j the head had not
             seen, so draft-time entries (built on guesses) never outlive their step.
  chain:     lm_head(f^_{N-1}) -> x^_N; the pair (f^_{N-1}, x^_N) at position N - 1 gives
             f^_N -> x^_{N+1}, ... (greedy: argmax; sampling: a draw from q, verified by
             rejection sampling with that q);
  tree:      EAGLE-2 (drafters/eagle_tree.py), a deterministic tree (probs=None).
"""
from __future__ import annotations

import torch

from forerun.config import SamplingParams
from forerun.drafters import eagle_tree
from forerun.drafters.base import Draft, DraftRequest, register
from forerun.drafters.draft_vocab import for_rows
from forerun.drafters.features import ReadsHidden
from forerun.drafters.tree_select import TreeOptions
from forerun.kv.cache import KVCache, chain_batch
from forerun.sampling import draw


class EagleDrafter(ReadsHidden):
    name = "eagle"

    def __init__(self, model, head, tree: TreeOptions = TreeOptions(), max_depth: int = 8, logits=None):
        self.model, self.head, self.tree, self.max_depth = model, head, tree, max_depth
        self.logits = logits or model.hidden_to_logits  # hidden [..., H] -> [..., V] (see draft_vocab.head_logits)
        self.cache: KVCache | None = None
        self.synced: dict[int, int] = {}  # row -> pairs 0 .. synced - 1 hold true features in self.cache

    def max_draft_nodes(self, k: int) -> int:
        return self.tree.nodes if self.tree.is_tree else k

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        self.start_features(num_rows, capacity)
        # drafting writes past the committed pairs: a chain k slots, a tree up to beam per depth (+ padding)
        self.cache = self.head.new_cache(num_rows, capacity + self.tree.beam * (self.max_depth + 1))
        self.synced = {}

    def release(self, row: int) -> None:
        super().release(row)
        self.synced.pop(row, None)

    def run(self, feats: torch.Tensor, tokens: torch.Tensor, batch) -> torch.Tensor:
        """The head on pairs (feats [B, T, H], tokens [B, T]) at batch's positions -> [B, T, H]."""
        embeds = self.model.model.embed_tokens(tokens).to(feats.dtype)
        return self.head(feats, embeds, batch, self.cache)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], params: SamplingParams, generator) -> list[Draft]:
        live = [r for r in requests if r.k > 0 and len(r.tokens) > 1 and self.features.covers(r.row, len(r.tokens) - 1)]
        if not live:
            return [Draft([]) for _ in requests]
        for_rows(self.logits, live)  # a reduced head (draft_vocab) then also scores their context ids
        guess = self._catch_up(live)  # [B, H] f^_{N-1} per live row
        if self.tree.is_tree:
            made = eagle_tree.grow(self, live, guess, [min(r.k, self.max_depth) for r in live])
        else:
            made = self._chain(live, guess, params, generator)
        drafts = dict(zip((r.row for r in live), made))
        return [drafts.get(r.row, Draft([])) for r in requests]

    def _catch_up(self, live: list[DraftRequest]) -> torch.Tensor:
        """Feed every row's pairs the head has not seen with true features; [B, H] the guess
        at the last one (f^_{N-1})."""
        starts = [min(self.synced.get(r.row, 0), len(r.tokens) - 2) for r in live]
        toks = [r.tokens[s + 1 :] for r, s in zip(live, starts)]  # x_{j+1}, j = s .. N - 2
        batch = chain_batch(toks, starts, [r.row for r in live], self.model.device)
        T = batch.tokens.shape[1]
        feats = torch.stack([_pad_rows(self.features.span(r.row, s, len(r.tokens) - 1), T) for r, s in zip(live, starts)])
        out = self.run(feats, batch.tokens, batch)  # [B, T, H]
        for r in live:
            self.synced[r.row] = len(r.tokens) - 1
        last = torch.tensor([len(t) - 1 for t in toks], device=out.device)
        return out[torch.arange(len(live), device=out.device), last]

    def _chain(self, live: list[DraftRequest], guess: torch.Tensor, params: SamplingParams, generator) -> list[Draft]:
        toks = {r.row: [] for r in live}
        qs = {r.row: [] for r in live}
        rows, pos = list(live), [len(r.tokens) - 1 for r in live]  # the next pair sits at the pending position
        for step in range(max(r.k for r in live)):
            picked, q = draw(self.logits(guess), params, generator)
            for i, r in enumerate(rows):
                toks[r.row].append(picked[i])
                if q is not None:
                    qs[r.row].append(q[i])
            keep = [i for i, r in enumerate(rows) if r.k > step + 1]
            if not keep:
                break
            rows = [rows[i] for i in keep]
            batch = chain_batch([[picked[i]] for i in keep], [pos[i] for i in keep], [r.row for r in rows], self.model.device)
            guess = self.run(guess[keep][:, None], batch.tokens, batch)[:, 0]
            pos = [pos[i] + 1 for i in keep]
        return [Draft.of(toks[r.row], qs[r.row]) for r in live]


def _pad_rows(x: torch.Tensor, T: int) -> torch.Tensor:
    """[n, H] -> [T, H], repeating the last row (chain_batch pads tokens the same way)."""
    return torch.cat([x, x[-1:].expand(T - x.shape[0], -1)]) if x.shape[0] < T else x


@register("eagle")
def _make(spec, verifier, **_) -> EagleDrafter:
    from forerun.drafters.draft_vocab import head_logits
    from forerun.heads.checkpoint import at_verifier_precision, load_head

    head = at_verifier_precision(load_head(spec.draft_model, "eagle", verifier.model), spec, verifier)
    return EagleDrafter(verifier.model, head, TreeOptions.from_spec(spec), spec.k_max, head_logits(spec, verifier))
