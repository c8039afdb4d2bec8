"""OpenAI response bodies and SSE chunks for completions and chat, built from engine events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from forerun.serve.request import Event


@dataclass
class Shape:
    """What differs between /v1/completions and /v1/chat/completions."""

    chat: bool
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def full(self, text: str, last: Event) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=self.usage(last.completion_tokens), forerun=spec_summary(last))
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        return sse(body)

    def usage_chunk(self, last: Event) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.usage(last.completion_tokens), forerun=spec_summary(last))
        return sse(body)


def spec_summary(last: Event) -> dict | None:
    s = last.stats
    if s is None:
        return None
    return {"drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_accepted_length": round(s.mean_accepted_length, 4), "verifier_forwards": s.verifier_forwards}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
