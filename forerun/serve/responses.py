"""OpenAI response bodies and SSE chunks for completions and chat, built from engine events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from forerun.serve.logprob_format import chat_logprobs, completion_logprobs
from forerun.serve.request import Event
from forerun.structured.tools import held_back, parse as parse_calls


@dataclass
class Echo:
    """A completion's echoed prompt: its ids, text and (with logprobs) its TokenLogprobs."""

    ids: list[int]
    text: str
    entries: list | None  # [len(ids)]: None first, then TokenLogprobs; None without logprobs
    piece: Callable[[int], str]  # token id -> its text


@dataclass
class Shape:
    """What differs between /v1/completions and /v1/chat/completions."""

    chat: bool
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    echo: Echo | None = None  # completions with echo: the prompt comes first
    logprob_n: int | None = None  # top alternatives per token; None = no logprobs in the response
    _offset: int = 0  # completions: text_offset of the next streamed token
    notes: tuple[str, ...] = ()  # what the server changed in the request (a clamped k), in the `forerun` field
    tools: bool = False  # chat with tools: calls in the text become message.tool_calls (structured/tools.py)
    index: int = 0  # the choice this shape writes (n > 1: one shape per choice, one id for all)
    _text: str = ""  # streamed with tools: the text so far
    _sent: int = 0  # ... and how much of it went out as content

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def _logprobs(self, entries: list | None, first: bool) -> dict | None:
        """This piece of the response's logprobs (first: the echoed prompt's come before)."""
        if self.logprob_n is None:
            return None
        entries = entries or []
        if self.chat:
            return chat_logprobs(entries, self.logprob_n)
        if first and self.echo is not None:
            head = completion_logprobs(self.echo.entries, self.echo.ids, self.echo.piece)
            self._offset = len(self.echo.text)
        else:
            head = completion_logprobs([], [], None)
        tail = completion_logprobs(entries, [next(iter(e)) for e in entries], None, self._offset)
        self._offset = tail["text_offset"][-1] + len(tail["tokens"][-1]) if entries else self._offset
        return {key: head[key] + tail[key] for key in head}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int, last: Event | None = None) -> dict:
        cached = last.stats.cached_tokens if last is not None and last.stats is not None else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def full(self, text: str, last: Event, entries: list | None = None) -> dict:
        """The whole response; entries: every generated token's TokenLogprobs (when asked)."""
        logprobs = self._logprobs(entries, first=True)
        if self.chat:
            message, finish = {"role": "assistant", "content": text}, last.finish_reason
            if self.tools:
                content, calls = parse_calls(text)
                if calls:
                    message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
            choice = {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            body = self._head("chat.completion")
        else:
            text = (self.echo.text if self.echo is not None else "") + text
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=self.usage(last.completion_tokens, last), forerun=self.forerun(last))
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False, logprobs: list | None = None) -> str:
        """One SSE chunk; logprobs: the TokenLogprobs of the tokens this chunk's text came from."""
        lp = self._logprobs(logprobs, first) if (logprobs or (first and self.echo is not None)) else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            text = (self.echo.text if first and self.echo is not None else "") + text
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if finish_reason and self.notes:  # (streamed: the last chunk says it; the usage chunk too)
            body["forerun"] = {"notes": list(self.notes)}
        return sse(body)

    def streamable(self, text: str) -> str:
        """The part of newly decoded text that may be streamed as content now: everything, or
        with tools everything before a call (a call goes out whole, as tool_calls, at the end)."""
        if not self.tools:
            return text
        self._text += text
        upto = max(self._sent, held_back(self._text))
        out, self._sent = self._text[self._sent : upto], upto
        return out

    def tool_chunks(self, finish_reason: str) -> tuple[list[str], str]:
        """With tools, at the end: the chunks of held-back text or of the calls (id and name, and
        arguments whole: the deltas join to exactly the final arguments), and the finish reason."""
        if not self.tools:
            return [], finish_reason
        _, calls = parse_calls(self._text)
        if not calls:
            rest = self._text[self._sent :]
            return ([self.chunk(rest)] if rest else []), finish_reason
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": self.index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}]
        return [sse(body)], "tool_calls"

    def usage_chunk(self, last: Event, completion_tokens: int | None = None) -> str:
        """The last chunk's usage; completion_tokens: every choice's together (n > 1)."""
        tokens = last.completion_tokens if completion_tokens is None else completion_tokens
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.usage(tokens, last), forerun=self.forerun(last))
        return sse(body)

    def forerun(self, last: Event) -> dict | None:
        """forerun's own field: the speculation summary and the notes."""
        summary = spec_summary(last)
        return {**(summary or {}), "notes": list(self.notes)} if self.notes else summary


def spec_summary(last: Event) -> dict | None:
    s = last.stats
    if s is None:
        return None
    return {"drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_accepted_length": round(s.mean_accepted_length, 4), "verifier_forwards": s.verifier_forwards,
            "forced": s.forced, "prefill_s": round(s.prefill_time, 4), "decode_s": round(s.decode_time, 4)}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
