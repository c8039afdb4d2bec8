"""Streaming text per sequence: emit only what can no longer change.

Two things can change text already decoded: a multi-byte character still arriving in
byte pieces (the text ends in U+FFFD), and a stop string still forming (the text ends in
a prefix of it, which the final output cuts). So each update re-decodes the sequence's
generated tokens, cuts at a stop string, holds back the last len(longest stop) - 1
characters and any trailing U+FFFD until the sequence finishes, and emits the new part.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


def stop_index(text: str, stops) -> int | None:
    """Where the earliest stop string starts in text, or None."""
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def hits_stop(decode: Callable[[list[int]], str], generated: list[int], stops) -> bool:
    """Whether the text of `generated` now holds a stop string: the one rule `LLM` and the
    server stop a sequence by. Only the last tokens are decoded, enough to spell any stop
    string (4 per character, + 8), so the check costs the same at any length.

    >>> hits_stop(lambda ids: "".join(map(chr, ids)), [ord(c) for c in "say END now"], ("END",))
    True
    """
    if not stops:
        return False
    tail = 4 * max(len(s) for s in stops) + 8  # tokens enough to spell any stop string
    return stop_index(decode(generated[-tail:]), stops) is not None


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], emit: Callable[[int, str], None]):
        self.decode, self.stops, self.emit = decode, stops, emit
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent: dict[int, str] = {}

    def update(self, index: int, generated: list[int], finished: bool) -> None:
        text = self.decode(generated)
        cut = stop_index(text, self.stops)
        if cut is not None:
            text, finished = text[:cut], True
        if not finished:
            text = text[: len(text) - self.hold] if self.hold else text
            text = text.rstrip(REPLACEMENT)
        sent = self.sent.get(index, "")
        if len(text) > len(sent) and text.startswith(sent):
            self.emit(index, text[len(sent):])
            self.sent[index] = text
