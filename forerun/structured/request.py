"""A request's structured-output fields -> one `StructuredOutputs` (or None): pure functions.

Three spellings reach a server, and a request may use only one of them:
- OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object), {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ..., options};
- vLLM's older top-level fields: guided_json, guided_regex, guided_choice, guided_grammar (with
  guided_whitespace_pattern, guided_decoding_backend).

Whitespace: forerun writes compact JSON unless `structured_outputs.whitespace_flexible` is true.
vLLM's `disable_any_whitespace` is accepted: true is forerun's default already, false leaves it.
Enforcement is always strict, whatever `json_schema.strict` says (the grammar either holds or not).
"""
from __future__ import annotations

from collections.abc import Mapping

from forerun.errors import FieldError
from forerun.structured.spec import KINDS, StructuredOutputs, is_set

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OPTIONS = ("whitespace_flexible", "whitespace_pattern", "disable_additional_properties")
ACCEPTED = ("disable_any_whitespace", "disable_fallback")  # vLLM options with nothing to change here
BACKENDS = (None, "auto", "guidance", "llguidance")  # guided_decoding_backend values forerun honours


def from_response_format(response_format, field: str = "response_format") -> StructuredOutputs | None:
    """OpenAI's response_format -> a constraint; None for {"type": "text"} or no field.

    >>> from_response_format({"type": "json_object"}).json_object
    True
    >>> spec = from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string"}}})
    >>> spec.json, spec.field
    ('{"type":"string"}', 'response_format.json_schema.schema')
    >>> from_response_format({"type": "json_schema", "json_schema": {"name": "p"}})
    Traceback (most recent call last):
    forerun.errors.FieldError: response_format.json_schema.schema: is required
    >>> from_response_format({"type": "xml"})
    Traceback (most recent call last):
    forerun.errors.FieldError: response_format.type: must be one of text, json_object, json_schema, got 'xml'
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise FieldError(field, f"must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, field=f"{field}.type")
    if kind != "json_schema":
        raise FieldError(f"{field}.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, Mapping):
        raise FieldError(f"{field}.json_schema", "is required for type json_schema and must be an object")
    if wrapper.get("schema") is None:
        raise FieldError(f"{field}.json_schema.schema", "is required")
    return StructuredOutputs(json=wrapper["schema"], field=f"{field}.json_schema.schema")


def from_structured_outputs(params, field: str = "structured_outputs") -> StructuredOutputs | None:
    """vLLM's structured_outputs object -> a constraint; unknown keys are refused by name.

    >>> from_structured_outputs({"regex": "[0-9]+", "disable_any_whitespace": True}).regex
    '[0-9]+'
    >>> from_structured_outputs({"choice": ["a"], "structural_tag": "{}"})
    Traceback (most recent call last):
    forerun.errors.FieldError: structured_outputs.structural_tag: is not supported by forerun
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise FieldError(field, f"must be an object, got {type(params).__name__}")
    for key, value in params.items():
        if key not in (*KINDS, *OPTIONS, *ACCEPTED) and value is not None:
            raise FieldError(f"{field}.{key}", "is not supported by forerun")
    for key in ACCEPTED:
        if params.get(key) is not None and not isinstance(params[key], bool):
            raise FieldError(f"{field}.{key}", f"must be true or false, got {params[key]!r}")
    chosen = [kind for kind in KINDS if is_set(kind, params.get(kind))]
    kind_field = f"{field}.{chosen[0]}" if len(chosen) == 1 else field
    options = {key: params[key] for key in OPTIONS if params.get(key) is not None}
    return StructuredOutputs(**{kind: params.get(kind) for kind in KINDS if kind in params and params[kind] is not None},
                             **options, field=kind_field)


def from_request(body: Mapping) -> StructuredOutputs | None:
    """The one constraint a request body sets (response_format, structured_outputs or a guided_*
    field), or None; two of them at once are refused, naming both.

    >>> from_request({"guided_choice": ["red", "green"]}).field
    'guided_choice'
    >>> from_request({"model": "m", "prompt": "hi"}) is None
    True
    >>> from_request({"guided_regex": "a+", "response_format": {"type": "json_object"}})
    Traceback (most recent call last):
    forerun.errors.FieldError: guided_regex: set one structured output per request; this one also sets response_format
    """
    found = []  # (field, spec)
    if (spec := from_response_format(body.get("response_format"))) is not None:
        found.append(("response_format", spec))
    if (spec := from_structured_outputs(body.get("structured_outputs"))) is not None:
        found.append(("structured_outputs", spec))
    _check_backend(body.get("guided_decoding_backend"))
    pattern = body.get("guided_whitespace_pattern")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            extra = {"whitespace_pattern": pattern} if pattern is not None and kind == "json" else {}
            found.append((name, StructuredOutputs(**{kind: body[name]}, **extra, field=name)))
    if pattern is not None and not any(name == "guided_json" for name, _ in found):
        raise FieldError("guided_whitespace_pattern", "applies to guided_json only")
    if len(found) > 1:
        names = [name for name, _ in found]
        raise FieldError(names[-1], f"set one structured output per request; this one also sets {', '.join(names[:-1])}")
    return found[0][1] if found else None


def _check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise FieldError("guided_decoding_backend", f"forerun's grammar engine is llguidance ('guidance'), got {backend!r}")
