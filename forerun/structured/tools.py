"""Tool calls in the form Qwen2.5's chat template teaches (Hermes' form): each call is
`<tool_call>\\n{"name": "<function>", "arguments": <JSON object>}\\n</tool_call>`, several
separated by a newline. Pure functions: the grammar a request's tools and tool_choice ask
for, and the parse of an answer back into OpenAI's `tool_calls`.

The arguments are written as the template's `tojson` writes them (", " and ": " between
items), so a call sent back in the next turn's history renders to the tokens the model
emitted and the prefix cache keeps hitting through it.

tool_choice: "none" -> no constraint; "auto" -> free text until the model opens a call, the
call itself constrained (lazy.TriggeredGrammar); "required" -> one or more calls from the
start; {"type": "function", "function": {"name": n}} -> a call of n from the start.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from forerun.errors import FieldError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": False}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: str  # the arguments' JSON schema, as JSON text (hashable)

    @classmethod
    def of(cls, entry: dict, where: str) -> "Tool":
        """One OpenAI tools[] entry: {"type": "function", "function": {"name", "parameters", ...}}."""
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or entry.get("type", "function") != "function":
            raise FieldError(where, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"{where}.function.name", f"must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise FieldError(f"{where}.function.parameters", "must be a JSON schema object")
        return cls(name, json.dumps(params, sort_keys=False))


def check_template(template: str | None) -> None:
    """A 400 on `tools` for a chat template that cannot show the model its tools, or that
    writes calls in another form than the one parsed here."""
    if not template or "tools" not in template:
        raise FieldError("tools", "this model's chat template has no place for tools (it cannot be asked to call "
                                  "functions); use a model whose template renders them, such as Qwen2.5")
    if OPEN not in template:
        raise FieldError("tools", f"this model's chat template writes tool calls in a form forerun does not parse "
                                  f"(it parses {OPEN} JSON {CLOSE}, Qwen2.5's and Hermes' form)")


def chosen(tools: list[Tool], choice) -> tuple[str, list[Tool]]:
    """(mode, the tools a call may name) for a tool_choice: mode is none, auto or required."""
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise FieldError("tool_choice", f"must be none, auto, required or a named function, got {choice!r}")
        return choice, tools
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    match = [t for t in tools if t.name == name]
    if not match:
        raise FieldError("tool_choice", f"names function {name!r}, which is not among tools: {[t.name for t in tools]}")
    return "required", match


def grammar(tools: list[Tool], parallel: bool, after_open: bool = False, marks: tuple[int, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or several with `parallel`, of these
    tools; `after_open`: the text after a first `<tool_call>` the model already wrote. marks:
    the ids of the tokens `<tool_call>` and `</tool_call>` where the tokenizer has them whole
    (Qwen2.5's added tokens): the grammar names those tokens, as the model emits them.

    >>> print(grammar([Tool("f", '{"type": "object"}')], parallel=False).splitlines()[1])
    call_0: "<tool_call>" "\\n{\\"name\\": \\"f\\", \\"arguments\\": " args_0 "}\\n" "</tool_call>"
    >>> grammar([Tool("f", '{}')], parallel=True, marks=(7, 8)).splitlines()[1].split()[:2]
    ['call_0:', '<[7]>']
    """
    opening, closing = (f"<[{marks[0]}]>", f"<[{marks[1]}]>") if marks else (json.dumps(OPEN), json.dumps(CLOSE))
    lines = ["start: first" + (' ("\\n" call)*' if parallel else "")]
    for i, t in enumerate(tools):
        head, tail = json.dumps(f'\n{{"name": "{t.name}", "arguments": '), json.dumps("}\n")
        lines.append(f"call_{i}: {opening} {head} args_{i} {tail} {closing}")
        lines.append(f"rest_{i}: {head} args_{i} {tail} {closing}")
        schema = {**json.loads(t.parameters), "x-guidance": SEPARATORS}
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    lines.append("first: " + " | ".join(f"{'rest' if after_open else 'call'}_{i}" for i in range(len(tools))))
    return "\n".join(lines)


def compiled(compile_grammar, marks: tuple[int, int] | None, tools: list[Tool], mode: str, parallel: bool):
    """The grammar a row follows for these tools (None under "none"): compile_grammar compiles a
    StructuredOutputs (LLM.compile_grammar); marks: the ids of the single tokens OPEN and CLOSE;
    "auto" waits for OPEN's (without them, "auto" leaves the text free and only parses it)."""
    from forerun.structured.lazy import TriggeredGrammar
    from forerun.structured.spec import StructuredOutputs

    if mode == "none" or (mode == "auto" and marks is None):
        return None
    if mode == "auto":
        inner = StructuredOutputs(grammar=grammar(tools, parallel, True, marks), field="tools")
        return TriggeredGrammar(compile_grammar(inner), marks[0])
    return compile_grammar(StructuredOutputs(grammar=grammar(tools, parallel, marks=marks), field="tools"))


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls): the text before the first call, and each complete call as OpenAI
    returns it (arguments as a JSON string). Text that does not parse stays content.

    >>> content, calls = parse('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> content, calls[0]["function"]
    ('Sure.\\n', {'name': 'f', 'arguments': '{"x": 1}'})
    """
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    return (text[:start] if text[:start].strip() else None), calls


def held_back(text: str) -> int:
    """How much of streamed text may go out as content: all of it but a call (from OPEN on) or
    a tail that could still become OPEN.
    >>> held_back("abc<tool"), held_back("abc <tool_call>{"), held_back("abc")
    (3, 4, 3)
    """
    at = text.find(OPEN)
    if at >= 0:
        return at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)
