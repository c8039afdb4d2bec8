"""A validated body -> a ServeRequest within the server's limits, or an ApiError (4xx)."""
from __future__ import annotations

from dataclasses import dataclass

from forerun.config import SamplingParams
from forerun.errors import FieldError, ForerunError
from forerun.serve.auth import salt
from forerun.serve.request import ServeRequest
from forerun.serve.schemas import Sampling


class ApiError(Exception):
    """An error the client caused: becomes {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    model_names: tuple[str, ...]  # what `model` may say (None / absent = the served model)
    max_len: int  # prompt + generated tokens
    default_max_tokens: int | None  # a request's max_tokens when it names none; None: the rest of the context
    method: str | None  # the server's drafter, None = speculation off server-wide
    k_max: int


def check_model(body: Sampling, limits: Limits) -> None:
    if body.model is not None and body.model not in limits.model_names:
        raise ApiError(404, f"model {body.model!r} is not served here; available: {list(limits.model_names)}",
                       code="model_not_found", param="model")


def request_k(body: Sampling, limits: Limits) -> int:
    """The request's draft length: the server's k unless it asks for less, or for none."""
    spec = body.speculative
    if spec is None:
        return limits.k_max if limits.method else 0
    if spec.method not in (None, "none", limits.method):
        raise ApiError(400, f"speculative.method must be 'none' or this server's method {limits.method!r}, got {spec.method!r}",
                       param="speculative.method")
    if spec.method == "none" or limits.method is None:
        return 0
    return limits.k_max if spec.k is None else min(spec.k, limits.k_max)


def k_note(body: Sampling, limits: Limits) -> str | None:
    """What the response's `forerun` field says when request_k cut the k the request asked for."""
    spec = body.speculative
    if spec is None or spec.k is None or spec.method == "none" or limits.method is None or spec.k <= limits.k_max:
        return None
    return f"speculative.k {spec.k} is above this server's k ({limits.k_max}): clamped to {limits.k_max}"


def prompt_ids(llm, body: Sampling, prompt, limits: Limits) -> list[int]:
    check_model(body, limits)
    try:
        return llm.encode(prompt)[0]
    except ForerunError as e:
        raise ApiError(400, str(e), param="prompt") from e


def build_request(llm, body: Sampling, prompt, max_tokens: int | None, limits: Limits, sink,
                  logprobs: int | None = None, tenant: bytes = b"", grammar=None) -> ServeRequest:
    """grammar: the request's compiled structured output (compile_structured), or None."""
    ids = prompt_ids(llm, body, prompt, limits)
    room = limits.max_len - len(ids)
    if room < 1:
        raise ApiError(400, f"prompt is {len(ids)} tokens; this server's context is {limits.max_len} tokens",
                       code="context_length_exceeded", param="prompt")
    default = room if limits.default_max_tokens is None else min(limits.default_max_tokens, room)
    wanted = max_tokens if max_tokens is not None else default  # (None: the rest of the context, as vLLM)
    if wanted > room:
        raise ApiError(400, f"max_tokens {wanted} + prompt {len(ids)} tokens exceeds this server's context of {limits.max_len}",
                       code="context_length_exceeded", param="max_tokens")
    try:
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=wanted,
                                seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos, logprobs=logprobs,
                                structured=grammar.spec if grammar is not None else None,
                                logit_bias=_bias(body, llm), presence_penalty=body.presence_penalty,
                                frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty)
    except ForerunError as e:
        raise ApiError(400, str(e)) from e
    return ServeRequest(ids, params, wanted, request_k(body, limits), sink, cache_salt=salt(tenant, body.cache_salt),
                        grammar=grammar)


def _bias(body: Sampling, llm) -> dict[int, float] | None:
    if not body.logit_bias:
        return None
    vocab = llm.model.config.vocab_size
    bias = {int(k): float(v) for k, v in body.logit_bias.items()}
    if any(k >= vocab for k in bias):
        raise ApiError(400, f"logit_bias: token ids must be below the vocabulary's {vocab}", param="logit_bias")
    return bias


def compile_structured(llm, body: Sampling):
    """The request's structured output compiled for the model's tokenizer (cached), or None; a
    400 naming the field where it is malformed, cannot compile, or asks what is not enforced.
    Slow only the first time (the tokenizer's table): callers run it off the event loop."""
    fields = body.structured_fields()
    if not fields:
        return None
    from forerun.structured import from_request

    try:
        spec = from_request(fields)
        return llm.compile_grammar(spec) if spec is not None else None
    except FieldError as e:
        raise ApiError(400, str(e), param=e.field) from e
    except ForerunError as e:
        raise ApiError(400, str(e), param=next(iter(fields))) from e
