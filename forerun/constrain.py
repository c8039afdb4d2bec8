"""Structured outputs inside the generate loop: per row, the grammar shapes the draft, masks
the verifier's logits at every drafted position, and follows the committed tokens.

A row with a grammar (Sequence.matcher, a structured.RowMatcher) is decoded exactly as plain
constrained decoding would decode it: at every position the verifier's logits are masked
with that position's grammar state, before temperature, top-k and top-p, so p is the masked
distribution plain decoding samples from, and verification keeps it.

Per step and constrained row (engine.step calls these in order):
  shape_draft   jump-forward as speculation: the run of tokens the grammar forces (the only
                one allowed, p = 1 under the mask: forced_run) leads the draft at no model
                cost, counted in Draft.forced; a drafter that drafts from tokens alone
                (suffix, n-gram) is asked to continue after the run, so a key the grammar
                forces is followed by the value the drafter expects; a one-hot draft is
                cut where the grammar refuses a token (its q is a point mass: leaving the
                token out is a choice made without drawing anything); a sampled draft is
                never cut after drawing (that would bias it, see below) but its refused
                token meets p = 0 and is rejected, the residual drawn from the masked p. A
                tree becomes its first branch.
  mask_logits   a copy of the logits with each drafted position's mask applied (the raw
                ones stay for logprobs, as vLLM reports them by default).
  follow        the committed tokens advance the grammar; a finished grammar ends the row.

Why a sampled draft is not cut: with p = (.5, .5, 0) and q = (.5, 0, .5), drawing x ~ q and
cutting the draft when x = 2 would emit token 0 with probability .5 + .5 x .5 = .75, not .5.
"""
from __future__ import annotations

import torch

from forerun.drafters.base import Draft


def forced_run(matcher, budget: int, forced_drafts: bool = True) -> list[int]:
    """The tokens a constrained row's grammar forces next (at most budget; none for a free row)."""
    return matcher.forced(budget) if matcher is not None and forced_drafts and budget > 0 else []


def shape_draft(matcher, draft: Draft, budget: int, run: list[int], after_run: bool = False) -> Draft:
    """The draft a constrained row verifies (budget: the most tokens it may draft; run: the
    tokens its grammar forces next, forced_run's). after_run: the drafter drafted from the
    committed tokens followed by the run (its draft continues the run: a deterministic drafter
    only, since which tokens it was asked about is then known before anything is drawn)."""
    if draft.is_tree:
        draft = first_branch(draft)
    if after_run and run:
        if draft.probs is not None:
            raise ValueError("only a deterministic draft (probs None) may continue a forced run")
        draft = Draft(run + draft.tokens)
    tokens = draft.tokens[:budget]
    if run and tokens[: len(run)] != run:  # the drafter disagrees with what the grammar forces
        return Draft(run, forced=len(run))
    if draft.probs is None:
        tokens = tokens[: matcher.check_draft(tokens)]
        return Draft(tokens if len(tokens) > len(run) else run, forced=len(run))
    return Draft(tokens, draft.probs[: len(tokens)], forced=len(run))


def first_branch(draft: Draft) -> Draft:
    """A tree's path through each node's first child, as a chain (the first child of every node
    is a draft of its own: an independent draw, or a deterministic proposal).
    >>> first_branch(Draft([5, 6, 7, 8], None, [-1, -1, 0, 2])).tokens
    [5, 7, 8]
    """
    path, node, parents = [], -1, draft.parent_list()
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        path.append(child)
        node = child
    probs = draft.probs[path] if draft.probs is not None else None
    return Draft([draft.tokens[i] for i in path], probs)


def mask_logits(logits: torch.Tensor, matchers: list, drafts: list[Draft]) -> torch.Tensor:
    """logits [B, T, V] with row b's positions 0 .. n_b masked by its grammar (n_b: the drafted
    tokens its grammar takes; positions past a refused token are never reached and stay as they
    are); the same tensor when no row has a grammar."""
    if all(m is None for m in matchers):
        return logits
    out = logits.clone()
    V = logits.shape[-1]
    for b, (m, d) in enumerate(zip(matchers, drafts)):
        if m is None:
            continue
        masks = m.draft_masks(d.tokens, V).to(logits.device)  # [n + 1, V]
        out[b, : masks.shape[0]].masked_fill_(~masks, float("-inf"))
    return out


def follow(matcher, token: int) -> bool:
    """Advance the row's grammar by a committed token; True when the grammar is now finished
    (nothing but EOS could follow: the row stops, as vLLM stops a terminated grammar)."""
    if not matcher.advance(token):
        raise RuntimeError(f"the grammar refused committed token {token}: {matcher.error or 'not allowed here'}")
    return matcher.is_done
