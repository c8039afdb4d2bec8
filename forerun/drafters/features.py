"""The verifier's hidden states per row and position, as drafters with `observe_hidden`
receive them (HiddenRows): a position-indexed buffer like the KV cache, so a rejected
draft needs no cleanup (later rows overwrite the stale positions)."""
from __future__ import annotations

import torch

from forerun.drafters.base import HiddenRows
from forerun.drafters.draft_vocab import forget_row, reset_rows


class FeatureStore:
    """[rows, capacity, H] hidden states; `known[row]` = positions 0 .. known - 1 are valid."""

    def __init__(self, num_rows: int, capacity: int):
        self.num_rows, self.capacity = num_rows, capacity
        self.buf: torch.Tensor | None = None  # allocated at the first write, in the hidden states' dtype
        self.known = [0] * num_rows

    def write(self, rows: list[HiddenRows]) -> None:
        for r in rows:
            n = r.hidden.shape[0]
            if self.buf is None:
                self.buf = r.hidden.new_zeros(self.num_rows, self.capacity, r.hidden.shape[-1])
            if r.start > self.known[r.row]:  # a gap: this row's earlier positions never arrived
                self.known[r.row] = 0
                continue
            self.buf[r.row, r.start : r.start + n] = r.hidden
            self.known[r.row] = r.start + n

    def covers(self, row: int, n: int) -> bool:
        """Positions 0 .. n - 1 of `row` are known."""
        return self.buf is not None and self.known[row] >= n

    def forget(self, row: int) -> None:
        self.known[row] = 0

    def at(self, rows: list[int], positions: list[int]) -> torch.Tensor:
        """[B, H] the hidden state of rows[b] at positions[b]."""
        dev = self.buf.device
        return self.buf[torch.tensor(rows, device=dev), torch.tensor(positions, device=dev)]

    def first(self, row: int, n: int) -> torch.Tensor | None:
        """[n, H] positions 0 .. n - 1 of one row (a view), or None where some never arrived:
        what a prefix cache keeps with the row's blocks (kv/prefix.py)."""
        return self.buf[row, :n] if self.covers(row, n) else None

    def span(self, row: int, start: int, end: int) -> torch.Tensor:
        """[end - start, H] positions start .. end - 1 of one row (a view)."""
        return self.buf[row, start:end]


class ReadsHidden:
    """What the drafters that read the verifier's hidden states share (Medusa, DFlash, EAGLE):
    a FeatureStore made at `start`, fed by `observe_hidden`, read back for the prefix cache by
    `hidden_rows`, and the per-row state of their head's logits (draft_vocab) forgotten with
    the row. They set `self.logits` and call `start_features` from their `start`."""

    features: FeatureStore | None = None
    logits = None  # hidden [..., H] -> [..., V]: the model's head, or draft_vocab's reduced one

    def start_features(self, num_rows: int, capacity: int) -> None:
        self.features = FeatureStore(num_rows, capacity)
        reset_rows(self.logits)

    def release(self, row: int) -> None:
        self.features.forget(row)
        forget_row(self.logits, row)

    def hidden_rows(self, row: int, n: int) -> torch.Tensor | None:
        """[n, H] the verifier's hidden states at the row's positions 0 .. n - 1, for the prefix
        cache to keep with its blocks; None where some never arrived."""
        return None if self.features is None else self.features.first(row, n)

    def observe_hidden(self, rows: list[HiddenRows]) -> None:
        self.features.write(rows)
