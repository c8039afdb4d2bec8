"""What a request constrains its output to: one JSON schema, regex, choice list or grammar.

`StructuredOutputs` has the shape of vLLM's `StructuredOutputsParams` (json, regex, choice, grammar,
json_object), with exactly one of them set. It is frozen and hashable, so a compiler can cache on it:
a schema given as a dict is kept as its JSON text (key order kept: the engine writes an object's
properties in the schema's order).

JSON is compact unless asked otherwise: no whitespace between tokens, because a small model given
free whitespace can spend its whole budget on newlines and spaces.

Every refusal is a `FieldError` naming the request field (`field`: where the constraint came from,
"structured_outputs.json" unless the request mapping in request.py says "guided_json" and so on).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field as _field

from forerun.errors import FieldError

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # exactly one is set


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a row's output, and how JSON is written.

    >>> spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    >>> spec.kind, spec.field, spec.json
    ('json', 'structured_outputs.json', '{"type":"object","properties":{"a":{"type":"integer"}}}')
    >>> StructuredOutputs(choice=["yes", "no"]).choice
    ('yes', 'no')
    >>> StructuredOutputs(regex="a", choice=["b"])
    Traceback (most recent call last):
    forerun.errors.FieldError: structured_outputs: set exactly one of json, regex, choice, grammar, json_object; got regex and choice
    """

    json: str | dict | bool | None = None  # a JSON schema; kept as its compact JSON text
    regex: str | None = None  # the whole output matches it (Rust regex syntax, no look-around)
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar: Lark (llguidance's dialect) or GBNF / EBNF
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    whitespace_flexible: bool = False  # JSON only: allow whitespace between tokens (default: compact)
    whitespace_pattern: str | None = None  # JSON only: the regex whitespace must match (vLLM's field)
    disable_additional_properties: bool = False  # JSON only: objects without additionalProperties get false
    field: str = _field(default="", compare=False)  # the request field it came from, for error messages

    def __post_init__(self):
        chosen = [kind for kind in KINDS if is_set(kind, getattr(self, kind))]
        if len(chosen) != 1:
            got = " and ".join(chosen) if chosen else "none"
            raise FieldError(self.field or "structured_outputs", f"set exactly one of {', '.join(KINDS)}; got {got}")
        kind = chosen[0]
        if not self.field:
            object.__setattr__(self, "field", f"structured_outputs.{kind}")
        normalise = {"json": _schema_text, "regex": _text, "grammar": _text, "choice": _choices, "json_object": _flag}
        object.__setattr__(self, kind, normalise[kind](getattr(self, kind), self.field))
        self._check_json_options(kind)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(kind for kind in KINDS if is_set(kind, getattr(self, kind)))

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")

    def _check_json_options(self, kind: str) -> None:
        """The JSON-only options are refused on a regex, choice or grammar rather than ignored."""
        base = self.field.rpartition(".")[0] or "structured_outputs"
        for name in ("whitespace_flexible", "disable_additional_properties"):
            _flag(getattr(self, name), f"{base}.{name}")
        if self.whitespace_pattern is not None:
            _text(self.whitespace_pattern, f"{base}.whitespace_pattern")
        if kind in ("json", "json_object"):
            return
        for name in ("whitespace_flexible", "whitespace_pattern", "disable_additional_properties"):
            if getattr(self, name) not in (None, False):
                raise FieldError(f"{base}.{name}", f"applies to json and json_object only, not to {kind}")


def is_set(kind: str, value) -> bool:
    """Whether a constraint field is given: json_object=False is not, json=False (the schema that
    matches nothing) is, and is refused."""
    return value is not None and not (kind == "json_object" and value is False)


def _schema_text(schema, field: str) -> str:
    """A schema (dict, true, or its JSON text) as compact JSON text, key order kept.
    >>> _schema_text('{"type": "string"}', "guided_json"), _schema_text(True, "guided_json")
    ('{"type":"string"}', '{}')
    >>> _schema_text("{nope", "guided_json")
    Traceback (most recent call last):
    forerun.errors.FieldError: guided_json: not valid JSON (Expecting property name enclosed in double quotes at 1)
    """
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except _json.JSONDecodeError as e:
            raise FieldError(field, f"not valid JSON ({e.msg} at {e.pos})") from None
    if not isinstance(schema, (dict, bool)):
        raise FieldError(field, f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
    if schema is False:
        raise FieldError(field, "the schema false matches nothing")
    if schema is True:  # any JSON value; the engine takes only object schemas
        schema = {}
    return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _text(value, field: str) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise FieldError(field, "is empty")
    return value


def _choices(value, field: str) -> tuple[str, ...]:
    """
    >>> _choices(["a", ""], "guided_choice")
    Traceback (most recent call last):
    forerun.errors.FieldError: guided_choice[1]: is empty
    """
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise FieldError(field, f"must be a list of strings, got {type(value).__name__}")
    if not value:
        raise FieldError(field, "is an empty list: no output would match")
    return tuple(_text(item, f"{field}[{i}]") for i, item in enumerate(value))


def _flag(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"must be true or false, got {value!r}")
    return value
