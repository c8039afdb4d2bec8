"""OpenAI request bodies, validated strictly: an unknown field or an absurd value is a 400
with an OpenAI-style error body, never a 500. Fields OpenAI defines but forerun does not
implement are accepted only at their neutral value (n = 1, penalties 0)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forerun.config import MIN_REPETITION_PENALTY

MAX_STOPS = 4
UNUSED = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "reasoning_effort", "user")
STRUCTURED_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend"}
MAX_LOGPROBS = 20  # forerun.logprobs.MAX_LOGPROBS (not imported: this module stays torch-free)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: true is not 1.0, "5" is not 5


class SpeculativeOptions(Strict):
    """forerun's extra body field: `"speculative": {"method": "ngram" | "none", "k": 3}`.
    method must be the server's drafter (or "none"); k above the server's k is lowered to it,
    and the response's `forerun.notes` says so."""

    method: str | None = None  # None: the server's method
    k: int | None = Field(default=None, ge=0, le=64)  # None: the server's k


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What completions and chat share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=1_000_000)
    n: int = Field(default=1, ge=1, le=16)  # choices (n requests decoded side by side, streamed interleaved)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=2.0, allow_inf_nan=False)  # vLLM's
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)  # token id (as text) -> [-100, 100]
    # OpenAI fields forerun accepts and does not use (named in the server's log, one line a request)
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    speculative: SpeculativeOptions | None = None
    # vLLM's field: the tenant's part of the prefix-cache keys; requests with another salt (or
    # none) never reuse this one's cached blocks.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Structured output (forerun/structured/request.py maps them; at most one per request):
    # OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", mode="before")
    @classmethod
    def _penalty_is_a_number(cls, v):
        if isinstance(v, bool):  # False == 0 would pass as a number
            raise ValueError("a penalty is a number, not true or false")
        if isinstance(v, int):  # strict mode refuses an int for a float; OpenAI's clients send 0
            return float(v)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, value in (v or {}).items():
            if not key.isdigit() or not -100.0 <= value <= 100.0:
                raise ValueError(f"maps token ids (digits) to values in [-100, 100]; got {key!r}: {value!r}")
        return v

    def unused_fields(self) -> list[str]:
        """The OpenAI fields this request set that forerun accepts without using."""
        return [f for f in UNUSED if getattr(self, f) is not None]

    @model_validator(mode="after")
    def _stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings of at most 256 characters")
        return self

    def structured_fields(self) -> dict:
        """The structured-output fields the request set (for structured.from_request)."""
        return {k: v for k, v in self.model_dump(include=STRUCTURED_FIELDS).items() if v is not None}

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (score the prompt)
    echo: bool = False  # the prompt's text (and its tokens' logprobs) before the completion
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # N alternatives per token
    best_of: Literal[1] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo (to score the prompt); send at least 1")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return p
        if len(p) != 1:
            raise ValueError("one prompt per request (n = 1)")
        return p[0]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # a JSON object, as text (OpenAI's form)


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = Field(default=None, max_length=128)  # OpenAI's function tools (structured/tools.py)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI's default
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None  # each generated token's logprob...
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # ...and the N most likely

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
