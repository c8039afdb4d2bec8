"""A grammar that holds from a trigger token on (tool_choice "auto"): the model writes free text,
and once it emits the trigger (Qwen2.5's <tool_call>) the rest must be a well-formed call.

`LazyMatcher` has RowMatcher's interface (mask, advance, rollback, check_draft, draft_masks,
forced, is_done), so the generate loop treats it as any grammar: before the trigger every
token is allowed, after it the inner grammar's row decides. The trigger is found among the
drafted tokens too, so a draft that crosses it is masked from the token after it, exactly
as plain decoding masks it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TriggeredGrammar:
    inner: object  # grammar.CompiledGrammar for the text after the trigger
    trigger: int  # the token id that starts it

    @property
    def spec(self):
        return self.inner.spec

    def matcher(self) -> "LazyMatcher":
        return LazyMatcher(self.inner, self.trigger)


class LazyMatcher:
    def __init__(self, inner, trigger: int):
        self.inner, self.trigger = inner, trigger
        self.free = 0  # tokens taken before the grammar began, the trigger included
        self.row = None  # the inner grammar's RowMatcher once triggered

    @property
    def consumed(self) -> int:
        return self.free + (self.row.consumed if self.row is not None else 0)

    @property
    def is_done(self) -> bool:
        return self.row is not None and self.row.is_done

    @property
    def accepts_eos(self) -> bool:
        return self.row is None or self.row.accepts_eos

    @property
    def error(self) -> str | None:
        return self.row.error if self.row is not None else None

    def advance(self, token: int) -> bool:
        if self.row is not None:
            return self.row.advance(token)
        self.free += 1
        if token == self.trigger:
            self.row = self.inner.matcher()
        return True

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.consumed:
            raise ValueError(f"rollback({n}): this row has consumed {self.consumed} tokens")
        if self.row is not None:
            inside = min(n, self.row.consumed)
            self.row.rollback(inside)
            n -= inside
            if n:  # the trigger itself goes
                self.row = None
        self.free -= n

    def mask(self, vocab_size: int) -> torch.Tensor:
        if self.row is None:
            return torch.ones(vocab_size, dtype=torch.bool)
        return self.row.mask(vocab_size)

    def check_draft(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            if not self.advance(int(t)):
                break
            n += 1
        self.rollback(n)
        return n

    def draft_masks(self, tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
        n = self.check_draft(tokens)
        rows = []
        for i in range(n + 1):
            rows.append(self.mask(vocab_size))
            if i < n:
                self.advance(int(tokens[i]))
        self.rollback(n)
        return torch.stack(rows)

    def forced(self, max_n: int) -> list[int]:
        return self.row.forced(max_n) if self.row is not None else []
