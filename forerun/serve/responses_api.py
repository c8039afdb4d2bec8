"""OpenAI's Responses API (`POST /v1/responses`): text, streaming, function tools and structured
output, enough for clients whose default is this API (openai-agents).

A Responses request is translated into the chat request it amounts to (input items ->
messages, `instructions` -> a system message, `text.format` -> response_format, function tools
and tool_choice in the chat form) and decoded as chat is: same template, same grammar, same
speculation. Nothing is stored: `previous_response_id` is a 400 naming it (send the whole
input instead); `store` is accepted and nothing is kept.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import Field

from forerun.serve.admission import ApiError
from forerun.serve.schemas import ChatRequest, Strict, UNUSED


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    reasoning: dict | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    speculative: dict | None = None  # forerun's field, as on chat
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM's field, as on chat: the tenant


def to_chat(body: ResponsesRequest) -> ChatRequest:
    """The chat request this Responses request amounts to; a 400 naming any field it cannot keep."""
    if body.previous_response_id is not None:
        raise ApiError(400, "previous_response_id: forerun stores no responses; send the whole conversation as input",
                       param="previous_response_id")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + _messages(body.input)
    chat = {"model": body.model, "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
            "speculative": body.speculative, "cache_salt": body.cache_salt}
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else \
            {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    for name in UNUSED:
        if getattr(body, name, None) is not None:
            chat[name] = getattr(body, name)
    try:
        return ChatRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValueError as e:
        raise ApiError(400, f"input: {e}", param="input") from e


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"input[{i}].role: must be user, system, developer or assistant", param=f"input[{i}].role")
            out.append({"role": item["role"], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ApiError(400, f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                                f"function_call_output)", param=f"input[{i}].type")
    return out


def _text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         for p in content):
        return "".join(p.get("text", "") for p in content)
    raise ApiError(400, f"input[{i}].content: text or a list of input_text parts", param=f"input[{i}].content")


def _tool(t: dict, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
    fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
    return {"type": "function", "function": fn}


def _format(fmt: dict) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, f"text.format.type: must be text, json_object or json_schema, got {kind!r}", param="text.format.type")


class ResponseShape:
    """The Responses API's objects and stream events for one answer."""

    def __init__(self, model: str, body: ResponsesRequest):
        self.id, self.model, self.body = f"resp_{uuid.uuid4().hex[:24]}", model, body
        self.created, self.seq = int(time.time()), 0
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"

    def response(self, status: str, output: list[dict], usage: dict | None = None, incomplete: str | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
                "parallel_tool_calls": b.parallel_tool_calls is not False, "text": b.text or {"format": {"type": "text"}},
                "previous_response_id": None, "store": False, "metadata": b.metadata or {}, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "usage": usage}

    def output(self, content: str | None, calls: list[dict]) -> list[dict]:
        items = []
        if content:
            items.append({"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": content, "annotations": []}]})
        for c in calls:
            items.append({"type": "function_call", "id": f"fc_{c['id'][5:]}", "call_id": c["id"], "status": "completed",
                          "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        return items

    @staticmethod
    def usage(chat_usage: dict) -> dict:
        return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
                "total_tokens": chat_usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields}, separators=(',', ':'))}\n\n"


def from_chat(shape: ResponseShape, reply: dict) -> dict:
    """A whole chat.completion -> the Response."""
    choice = reply["choices"][0]
    msg = choice["message"]
    output = shape.output(msg.get("content"), msg.get("tool_calls") or [])
    cut = choice["finish_reason"] == "length"
    return shape.response("incomplete" if cut else "completed", output, shape.usage(reply["usage"]),
                          "max_output_tokens" if cut else None)


async def events(shape: ResponseShape, chat_chunks):
    """The chat stream's SSE chunks -> the Responses stream's events."""
    yield shape.event("response.created", response=shape.response("in_progress", []))
    text, calls, finish, usage, opened = "", [], None, None, False
    async for chunk in chat_chunks:
        for line in chunk.split("\n"):
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                yield shape.event("error", message=obj["error"]["message"], code=obj["error"].get("code"))
                return
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                delta, finish = ch.get("delta") or {}, ch.get("finish_reason") or finish
                calls += delta.get("tool_calls") or []
                if delta.get("content"):
                    if not opened:
                        opened = True
                        item = {"type": "message", "id": shape.msg_id, "status": "in_progress", "role": "assistant", "content": []}
                        yield shape.event("response.output_item.added", output_index=0, item=item)
                        yield shape.event("response.content_part.added", item_id=shape.msg_id, output_index=0, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []})
                    text += delta["content"]
                    yield shape.event("response.output_text.delta", item_id=shape.msg_id, output_index=0, content_index=0,
                                      delta=delta["content"])
    output = shape.output(text, calls)
    if opened:
        part = output[0]["content"][0]
        yield shape.event("response.output_text.done", item_id=shape.msg_id, output_index=0, content_index=0, text=text)
        yield shape.event("response.content_part.done", item_id=shape.msg_id, output_index=0, content_index=0, part=part)
        yield shape.event("response.output_item.done", output_index=0, item=output[0])
    for i, item in enumerate(output[1:] if opened else output, start=int(opened)):
        yield shape.event("response.output_item.added", output_index=i, item={**item, "arguments": "", "status": "in_progress"})
        yield shape.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=item["arguments"])
        yield shape.event("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=item["arguments"])
        yield shape.event("response.output_item.done", output_index=i, item=item)
    cut = finish == "length"
    final = shape.response("incomplete" if cut else "completed", output, shape.usage(usage) if usage else None,
                           "max_output_tokens" if cut else None)
    yield shape.event("response.incomplete" if cut else "response.completed", response=final)
