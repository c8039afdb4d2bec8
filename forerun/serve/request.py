"""What the HTTP side hands the scheduler, and what comes back, token by token."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

from forerun.config import SamplingParams
from forerun.metrics import SpecStats

_ids = itertools.count()


@dataclass
class Event:
    """One message from the engine thread to a request's consumer."""

    text: str = ""  # new final text (never a stop string or half a character)
    finish_reason: str | None = None  # "stop" | "length" on the last event
    error: str | None = None  # the request failed inside the engine (last event)
    completion_tokens: int = 0  # generated so far
    stats: SpecStats | None = None  # on the last event
    token_ids: list[int] | None = None  # [n] every generated id, on the last event
    logprobs: list | None = None  # TokenLogprobs of the tokens generated since the previous event (when asked)


@dataclass
class ServeRequest:
    prompt: list[int]  # [P] token ids, 1 <= P < the server's max_len
    params: SamplingParams
    max_new: int  # already clipped so that prompt + generated <= max_len
    k: int  # longest draft this request allows (0 = plain decoding), <= the server's k_max
    sink: Callable[[Event], None]  # called on the engine thread; must not block
    cache_salt: bytes = b""  # the tenant's part of the prefix-cache keys
    grammar: object | None = None  # structured.CompiledGrammar the output follows (compiled at admission)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Safe from any thread: the scheduler drops the request before its next step."""
        self.cancelled.set()
