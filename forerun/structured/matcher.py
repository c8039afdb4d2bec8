"""One row's grammar state while it decodes: masks, advancing, rolling back, forced runs, drafts.

Vocabulary, for one row:
- state: the tokens the grammar has consumed; `consumed` counts them, `rollback(n)` undoes the last n.
- mask: BoolTensor [V], True where a token may come next. V is the model's logit width, which may
  exceed the tokenizer's `n_tokens` (embeddings padded past the last id): those ids are False.
  EOS ids are True exactly where the output so far is complete (`accepts_eos`).
- forced run: tokens each of which is the only one its state's mask allows (EOS excluded). A
  sampler would pick them with probability 1 once masked, so they can go into a draft at no
  model cost (jump-forward) and verification accepts them.
- draft check: how many of a draft's tokens the grammar takes in order; every position is checked
  against its own state (the state after the draft tokens before it). A token past that count is
  one the masked verifier gives probability 0.

Speculative decoding with a grammar, per row and step (exact: the verifier's distribution at every
position is the masked one plain decoding would use):
    run = m.forced(k)                      # jump-forward: tokens the mask leaves no choice about
    draft = run + proposal                 # proposal: the drafter's tokens after the run
    draft = draft[: m.check_draft(draft)]  # one-hot drafts (n-gram): cut at the first refused token
    masks = m.draft_masks(draft, V)        # [len(draft) + 1, V]: one per verifier logits row
    for token in committed: m.advance(token)   # accepted + the verifier's own token, nothing more
Cutting a one-hot draft is exact: the residual of a one-hot q at a token the mask gives p = 0 is
p itself. A drafter with a distribution q (a draft model) masks q instead, at each position, with a
matcher it advances along its own draft and then rolls back. `check_draft`, `draft_masks` and
`forced` leave the state as they found it.

The engine (llguidance) writes masks as bits, 32 token ids per int32 word, little-endian; they are
unpacked into bools with numpy.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import numpy as np
import torch

if sys.byteorder != "little":  # the bit order below reads int32 words as little-endian bytes
    raise ImportError("forerun.structured needs a little-endian machine")


class RowMatcher:
    """The grammar state of one row. `engine` is an llguidance LLMatcher this row owns (a copy of a
    compiled grammar's start state: GrammarCompiler.matcher builds it); `eos_ids` end the output;
    `n_tokens` is the tokenizer's vocabulary size (the grammar's ids are 0..n_tokens-1).

    EOS never reaches the engine: the row takes it where the engine says the output is complete,
    counts it in `consumed` like any token (so rollbacks count as the KV cache does), and after it
    allows nothing but EOS. (llguidance 1.9 refuses EOS in validate_tokens once an output is
    closed, and loses is_accepting when an EOS is rolled back.)
    """

    def __init__(self, engine, eos_ids: frozenset[int], n_tokens: int):
        self._engine = engine
        self.eos_ids = frozenset(eos_ids)
        self.n_tokens = n_tokens
        self.consumed = 0  # tokens taken, EOS included
        self.ended = False  # EOS taken: the output is over
        self._words = np.zeros((n_tokens + 31) // 32, dtype=np.int32)  # [W] one mask's bits

    # --- state ------------------------------------------------------------------------------------

    @property
    def accepts_eos(self) -> bool:
        """The output so far is complete: EOS may come next."""
        return not self.ended and self._engine.is_accepting()

    @property
    def is_done(self) -> bool:
        """Nothing but EOS may come next: EOS taken, the output complete and closed, or a dead end
        (see `error`)."""
        return self.ended or self._engine.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (no token would keep the output valid), or None."""
        message = self._engine.get_error()
        return message.split("\n", 1)[0] if message else None

    def advance(self, token: int) -> bool:
        """Take `token` if the grammar allows it here; False (state unchanged) if not."""
        if self.ended or not 0 <= token < self.n_tokens:
            return False
        if token in self.eos_ids:
            if not self._engine.is_accepting():
                return False
            self.ended = True
        elif self._engine.try_consume_tokens([token]) != 1:
            return False
        self.consumed += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n tokens (a rejected draft's, with the KV cache's)."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"rollback({n}): this row has consumed {self.consumed} tokens")
        in_engine = n - (1 if self.ended and n else 0)
        if in_engine and not self._engine.rollback(in_engine):
            raise RuntimeError(f"grammar rollback({in_engine}) failed: {self._engine.get_error()}")
        self.ended = self.ended and n == 0
        self.consumed -= n

    # --- masks ------------------------------------------------------------------------------------

    def mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """BoolTensor [vocab_size] (default n_tokens): True where a token may come next."""
        out = np.zeros(self._width(vocab_size), dtype=bool)
        self._fill(out)
        return torch.from_numpy(out)

    def draft_masks(self, tokens: Sequence[int], vocab_size: int | None = None) -> torch.Tensor:
        """BoolTensor [n + 1, vocab_size]: the mask before the draft and after each of its first n
        tokens, n = check_draft(tokens) (rows for the verifier's logits at those positions)."""
        n = self.check_draft(tokens)
        out = np.zeros((n + 1, self._width(vocab_size)), dtype=bool)
        for i in range(n + 1):
            self._fill(out[i])
            if i < n and not self.advance(int(tokens[i])):
                raise RuntimeError(f"grammar refused draft token {tokens[i]} it had allowed")
        self.rollback(n)
        return torch.from_numpy(out)

    def check_draft(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from this state (state unchanged);
        an EOS it takes is the last."""
        tokens = [int(t) for t in tokens]
        if self.ended:
            return 0
        stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids or not 0 <= t < self.n_tokens), len(tokens))
        n = self._engine.validate_tokens(tokens[:stop]) if stop else 0
        if n == stop < len(tokens) and tokens[stop] in self.eos_ids:  # complete after tokens[:stop]?
            self._engine.try_consume_tokens(tokens[:stop])
            n += self._engine.is_accepting()
            self._engine.rollback(stop)
        return n

    def forced(self, max_n: int) -> list[int]:
        """Up to max_n tokens, each the only one its state allows, EOS excluded (state unchanged)."""
        run: list[int] = []
        while len(run) < max_n and (token := self._only_allowed()) is not None and token not in self.eos_ids:
            if not self.advance(token):
                raise RuntimeError(f"grammar refused token {token}, the only one it allowed")
            run.append(token)
        self.rollback(len(run))
        return run

    # --- internals --------------------------------------------------------------------------------

    def _width(self, vocab_size: int | None) -> int:
        width = self.n_tokens if vocab_size is None else vocab_size
        if width < self.n_tokens:
            raise ValueError(f"vocab_size {width} is below the tokenizer's {self.n_tokens} tokens")
        return width

    def _fill_words(self, words: np.ndarray) -> None:
        """This state's mask as bits into words (int32 [W])."""
        if self.ended:
            bits = words.view(np.uint32)
            bits[:] = 0
            for eos in self.eos_ids:
                bits[eos // 32] |= np.uint32(1 << (eos % 32))
        else:
            self._engine.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def _fill(self, out: np.ndarray) -> None:
        """Write this state's mask into `out` (bool [>= n_tokens]; ids past n_tokens left as they are)."""
        self._fill_words(self._words)
        out[: self.n_tokens] = unpack(self._words, self.n_tokens)

    def _only_allowed(self) -> int | None:
        """The token id if exactly one is allowed here, else None."""
        self._fill_words(self._words)
        nonzero = np.flatnonzero(self._words)
        if len(nonzero) != 1:
            return None
        word = int(self._words[nonzero[0]]) & 0xFFFFFFFF
        return int(nonzero[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


def unpack(words: np.ndarray, n: int) -> np.ndarray:
    """The first n bits of int32 words as bools; bit b of word w is token 32 * w + b.
    >>> unpack(np.array([0b101, 1], dtype=np.int32), 34).nonzero()[0].tolist()
    [0, 2, 32]
    """
    return np.unpackbits(words.view(np.uint8), count=n, bitorder="little").view(bool)


def fill_masks(matchers: Sequence[RowMatcher], out: torch.Tensor) -> None:
    """Each row's mask into out (bool [len(matchers), V], on the CPU), ids past a row's n_tokens False.

    One native call computes all rows (llguidance's executor, on its own threads, outside the GIL).
    """
    if out.dtype != torch.bool or out.dim() != 2 or out.shape[0] != len(matchers) or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU bool tensor [{len(matchers)}, V], "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not matchers:
        return
    n_tokens = matchers[0].n_tokens
    if any(m.n_tokens != n_tokens for m in matchers) or out.shape[1] < n_tokens:
        raise ValueError(f"every row needs the same tokenizer and out [B, >= {n_tokens}]")
    words = np.zeros((len(matchers), (n_tokens + 31) // 32), dtype=np.int32)  # [B, W]
    live = [(m._engine, i) for i, m in enumerate(matchers) if not m.ended]
    if live:
        _executor().unsafe_compute_mask_ptr(live, words.ctypes.data, words.shape[1] * 4, len(matchers))
    for i, m in enumerate(matchers):
        if m.ended:
            m._fill_words(words[i])
    rows = out.numpy()
    rows[:, n_tokens:] = False
    for i in range(len(matchers)):
        rows[i, :n_tokens] = unpack(words[i], n_tokens)


@functools.cache
def _executor():
    """llguidance's thread pool for batched masks, made on first use."""
    import llguidance

    return llguidance.LLExecutor()
