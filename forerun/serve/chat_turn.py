"""A chat request -> the prompt the model reads, and the tool calls it may make.

Messages go to the model's chat template as the template expects them: an assistant turn's
tool_calls with their `arguments` parsed from OpenAI's JSON strings into objects (the
template writes them back with `tojson`, as the model wrote them: the history renders to the
tokens it emitted), a `tool` message as the tool's answer. Tools the template cannot show
the model, an unknown tool in tool_choice, arguments that are not a JSON object, or tools
beside a structured output: a 400 naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from forerun.errors import FieldError, ForerunError
from forerun.serve.admission import ApiError
from forerun.serve.schemas import ChatRequest


@dataclass
class ChatTurn:
    prompt: str
    tools: list  # structured.tools.Tool, the ones a call may name; [] = no tool calls parsed or constrained
    mode: str = "none"  # none / auto / required (a named function: required, one tool)
    parallel: bool = True

    def compile(self, llm):
        """The grammar the answer follows (None: free text); slow only on a model's first grammar."""
        from forerun.structured.tools import compiled

        marks = _single_token(llm.tokenizer, "<tool_call>"), _single_token(llm.tokenizer, "</tool_call>")
        try:
            return compiled(llm.compile_grammar, marks if None not in marks else None, self.tools, self.mode, self.parallel)
        except FieldError as e:
            raise ApiError(400, str(e), param=e.field) from e
        except ForerunError as e:
            raise ApiError(400, f"tools: {e}", param="tools") from e


def chat_turn(llm, body: ChatRequest) -> ChatTurn:
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
        raise ApiError(400, "every message is empty: nothing to answer", param="messages")
    tools, mode = _tools(llm, body)
    try:
        prompt = llm.apply_chat_template(messages, tools=body.tools or None)
    except Exception as e:  # a template that refuses a role order, a model without a template
        raise ApiError(400, f"chat template: {e}", param="messages") from e
    named = isinstance(body.tool_choice, dict)  # a named function: one call of it, as OpenAI answers
    return ChatTurn(prompt, tools if mode != "none" else [], mode, body.parallel_tool_calls is not False and not named)


def _tools(llm, body: ChatRequest) -> tuple[list, str]:
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: names a tool but the request has no tools", param="tool_choice")
        return [], "none"
    from forerun.structured.tools import Tool, check_template, chosen

    try:
        check_template(getattr(llm.tokenizer, "chat_template", None))
        tools = [Tool.of(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
        mode, allowed = chosen(tools, body.tool_choice)
    except FieldError as e:
        raise ApiError(400, str(e), param=e.field) from e
    if mode != "none" and body.structured_fields():
        field = next(iter(body.structured_fields()))
        raise ApiError(400, f"{field}: a structured output and tool calls in one request; send one of them "
                            "(or tool_choice none)", param=field)
    return allowed, mode


def _message(m, i: int) -> dict:
    out = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                args = json.loads(call.function.arguments)
            except ValueError as e:
                raise ApiError(400, f"{where}: not valid JSON ({e})", param=where) from e
            if not isinstance(args, dict):
                raise ApiError(400, f"{where}: must be a JSON object", param=where)
            calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _single_token(tokenizer, text: str) -> int | None:
    """The id of the one token that is exactly `text`, if the tokenizer has it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
