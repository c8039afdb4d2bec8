"""Writing K/V for known tokens (prompts, a drafter's catch-up) in bounded forwards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from forerun.kv.cache import KVCache, chain_batch

# Padded tokens (rows x longest) per forward: bounds the mask and activations. Small forwards keep
# their activations in cache, and the forwards are batch-invariant, so the bits are the same in any
# size: `python scripts/prefill_rate.py --budgets 128,4096` compares them (docs/results.md).
PREFILL_TOKEN_BUDGET = 128


@dataclass
class PrefixWrite:
    row: int
    start: int  # first slot to write
    tokens: list[int]


def write_prefixes(
    model, cache: KVCache, items: list[PrefixWrite], budget: int = PREFILL_TOKEN_BUDGET,
    on_hidden: Callable[[PrefixWrite, torch.Tensor], None] | None = None,
):
    """K/V for every item's tokens at slots start, start + 1, ... (no logits computed).

    Long items are cut into chunks of at most `budget` tokens; chunks are grouped into
    forwards of at most `budget` padded tokens, and a row's chunks always run in order.
    on_hidden(chunk, hidden [len(chunk.tokens), hidden_size]) receives each chunk's hidden
    states (the model's output after its final norm), for drafters that read them.
    """
    pieces = [
        PrefixWrite(it.row, it.start + off, it.tokens[off : off + budget])
        for it in items
        for off in range(0, len(it.tokens), budget)
    ]
    while pieces:
        group, rest, blocked, longest = [], [], set(), 0
        for p in pieces:
            wider = max(longest, len(p.tokens))
            if p.row in blocked or (group and wider * (len(group) + 1) > budget):
                blocked.add(p.row)  # this row's later chunks must wait for this one
                rest.append(p)
                continue
            group.append(p)
            blocked.add(p.row)
            longest = wider
        batch = chain_batch([p.tokens for p in group], [p.start for p in group], [p.row for p in group], model.device)
        out = model(batch, cache, logits_at=None)
        if on_hidden is not None:
            for i, p in enumerate(group):
                on_hidden(p, out.hidden[i, : len(p.tokens)])
        pieces = rest


def feed_all_but_last(model, cache: KVCache, rows: list[int], feeds: list[tuple[int, list[int]]]):
    """A drafter's catch-up: feeds[i] = (first slot, tokens) for rows[i]. Writes all but the
    last token of each (a whole prompt on the first step) in budgeted forwards and returns
    (starts, one-token feeds) for the drafting loop, whose first forward yields logits."""
    write_prefixes(model, cache, [PrefixWrite(r, s, f[:-1]) for r, (s, f) in zip(rows, feeds) if len(f) > 1])
    return [s + len(f) - 1 for s, f in feeds], [f[-1:] for _, f in feeds]
