"""Lookahead decoding (Fu et al. 2024): Jacobi iterations plus an n-gram pool, with no
model call of its own. Everything rides in the verifier's forward:

  tree fed per step = trie([Jacobi window] + pool n-grams that start after the pending token)

The window is a chain of W guesses for the next positions. The verifier's argmax at the
pending token and at each window node is one Jacobi iteration: the new guesses for the
positions after them. Keeping the last `ngram` iterations (as maps position -> guess)
gives n-grams along the diagonal, guess_t(p), guess_t+1(p + 1), ..., which fill the pool
keyed by their first token. Window and pool candidates are both deterministic proposals,
so the tree is verified with the one-hot rule and sampling stays exact (verify.tree_verify).

Differences from the paper, kept on purpose for a small CPU engine: one window level is
fed per step (the earlier levels are the stored past iterations rather than re-fed
tokens), and guesses are the verifier's argmax also when sampling (they only shape the
proposals, never the accepted distribution).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from forerun.drafters.base import Draft, DraftRequest, StepFeedback, register
from forerun.drafters.ngram import trie
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache


@dataclass
class _RowState:
    window: list[int]  # guesses for positions pending + 1, ..., pending + W
    history: list[dict[int, int]] = field(default_factory=list)  # past iterations, oldest first
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # first token -> continuations
    window_nodes: int = 0  # how many window tokens the last draft fed (its first nodes)


class LookaheadDrafter:
    name = "lookahead"

    def __init__(self, window: int = 5, ngram: int = 3, pool_size: int = 4, pool_per_key: int = 8):
        if window < 1 or ngram < 2 or pool_size < 0:
            raise ConfigError("lookahead needs window >= 1, ngram >= 2, pool_size >= 0")
        self.window, self.ngram, self.pool_size, self.pool_per_key = window, ngram, pool_size, pool_per_key
        self.rows: dict[int, _RowState] = {}

    def max_draft_nodes(self, k: int) -> int:
        return min(k, self.window) + self.pool_size * min(k, self.ngram - 1)

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        self.rows = {}

    def release(self, row: int) -> None:
        """A new sequence takes this row (the server's continuous batching)."""
        self.rows.pop(row, None)

    def propose(self, requests: list[DraftRequest], params, generator) -> list[Draft]:
        return [self._propose_row(r) for r in requests]

    def _propose_row(self, r: DraftRequest) -> Draft:
        st = self.rows.get(r.row)
        if st is None:  # initial guesses: the tokens that ended the prompt, as Jacobi starts anywhere
            st = self.rows[r.row] = _RowState(window=_fill([], r.tokens, self.window))
        window = st.window[: r.k]
        cands = [list(c[: r.k]) for c in st.pool.get(r.tokens[-1], [])[: self.pool_size]] if r.k else []
        tokens, parents = trie([window] + cands if window else cands)
        st.window_nodes = len(window)  # the window was inserted first: nodes 0 .. len - 1
        return Draft(tokens, None, parents)

    def observe(self, feedback: list[StepFeedback]) -> None:
        for f in feedback:
            st = self.rows[f.row]
            L = f.pending_pos
            # One Jacobi iteration: argmax at the pending token guesses L + 1, at window node i guesses L + 2 + i.
            new = {L + 1 + i: f.argmax[i] for i in range(st.window_nodes + 1)}
            st.history = (st.history + [new])[-self.ngram :]
            self._harvest(st)
            committed = [f.draft.tokens[n] for n in f.accepted] + [f.next_token]
            nxt = L + len(committed)  # the next pending position
            guesses = [new[p] for p in range(nxt + 1, L + 2 + st.window_nodes) if p in new]
            st.window = _fill(guesses, committed, self.window)

    def _harvest(self, st: _RowState) -> None:
        """n-grams along the diagonal of the last `ngram` iterations, into the pool."""
        if len(st.history) < self.ngram:
            return
        for p, first in st.history[0].items():
            gram = [st.history[j].get(p + j) for j in range(1, self.ngram)]
            if None in gram:
                continue
            bucket = st.pool.setdefault(first, [])
            gram = tuple(gram)
            if gram in bucket:
                bucket.remove(gram)
            bucket.insert(0, gram)  # most recent first
            del bucket[self.pool_per_key :]


def _fill(guesses: list[int], context: list[int], width: int) -> list[int]:
    """Pad the window to `width` with recent context tokens (any guess is a valid start)."""
    pad = list(context[-width:]) or [0]
    out = list(guesses[:width])
    while len(out) < width:
        out.append(pad[len(out) % len(pad)])
    return out


@register("lookahead")
def _make(spec, **_) -> LookaheadDrafter:
    return LookaheadDrafter(spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_pool)
