"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info. Clients that
count or build tokens against the server use them (lm-eval's local-completions finds them and
then needs no tokenizer of its own: `forerun serve` + `lm_eval` with only the model's name)."""
from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field

from forerun.errors import ForerunError
from forerun.serve.admission import ApiError, Limits, check_model
from forerun.serve.schemas import Message, Strict


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, llm, limits: Limits) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body, limits)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
        try:
            if body.messages is not None:
                text = llm.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
                ids = llm.tokenizer.encode(text, add_special_tokens=False)  # the template spells its specials
            else:
                llm.require_tokenizer()
                ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ForerunError as e:
            raise ApiError(400, str(e), param="messages" if body.messages is not None else "prompt") from e
        return {"count": len(ids), "max_model_len": limits.max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body, limits)
        vocab = llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        info = getattr(llm.tokenizer, "info", None)
        if info is None:
            raise ApiError(404, "this model's tokenizer describes no special tokens", code="not_found")
        return {**info(), "model_max_length": limits.max_len}
