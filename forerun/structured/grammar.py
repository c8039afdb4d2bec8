"""StructuredOutputs -> a compiled llguidance grammar, once per constraint and tokenizer.

`GrammarCompiler` belongs to one tokenizer (one per loaded model). It builds llguidance's token
table on first use (about a second for a 150k vocabulary), keeps the last `cache_size` compiled
grammars (LRU, keyed by the frozen spec), and hands each row its own `RowMatcher`: a copy of the
compiled start state, which costs about a microsecond.

Refusals, each a FieldError naming the spec's field:
- JSON schema keywords the engine would not enforce (uniqueItems, not, if/then, an unknown format,
  overlapping oneOf...) are `UnenforcedKeyword`, naming them. The engine's lenient mode, which
  would skip them silently, is forced off, whatever the schema's own "x-guidance" says.
- a schema or grammar the engine cannot compile: its message, trimmed to the line that says why;
- a constraint whose first step admits nothing (a regex like [a&&b], min > max): "matches no text".
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from forerun.errors import FieldError, ForerunError
from forerun.structured.matcher import RowMatcher
from forerun.structured.spec import StructuredOutputs


class UnenforcedKeyword(FieldError):
    """A JSON schema keyword the grammar engine accepts but would not enforce; `keywords` names them."""

    def __init__(self, field: str, keywords: tuple[str, ...], problem: str):
        super().__init__(field, problem)
        self.keywords = keywords


@dataclass(frozen=True)
class CompiledGrammar:
    spec: StructuredOutputs
    text: str  # llguidance's grammar (JSON text), what the start state was built from
    start: object  # llguidance.LLMatcher in the start state, never advanced: rows get copies
    eos_ids: frozenset[int]
    n_tokens: int  # the tokenizer's vocabulary size

    def matcher(self) -> RowMatcher:
        return RowMatcher(self.start.deep_copy(), self.eos_ids, self.n_tokens)


class GrammarCompiler:
    """Compiles constraints for one forerun Tokenizer and caches them (LRU of `cache_size`)."""

    def __init__(self, tokenizer, cache_size: int = 128):
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self.hits = self.misses = 0
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()
        self._engine_tokenizer = None  # llguidance.LLTokenizer, built on first compile
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputs) -> RowMatcher:
        """A fresh row state for `spec` (compiled on first sight, cached after)."""
        return self.compile(spec).matcher()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        with self._lock:
            if (compiled := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return compiled
            self.misses += 1
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance

        text = grammar_text(spec)
        start = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0)
        problems = [start.get_error()] if start.is_error() else start.get_grammar_warnings()
        if not problems:
            start.compute_bitmask()  # the first step: a language with no first token errs here
            problems = [start.get_error()] if start.is_error() else []
        if problems:
            raise refusal(spec, problems[0])
        tokenizer = self.tokenizer
        return CompiledGrammar(spec, text, start, frozenset(tokenizer.eos_token_ids), tokenizer.vocab_size)

    def _llg_tokenizer(self):
        with self._lock:
            if self._engine_tokenizer is None:
                import llguidance

                tokenizer = self.tokenizer
                eos = sorted(tokenizer.eos_token_ids) or None
                try:
                    self._engine_tokenizer = llguidance.LLTokenizer(
                        tokenizer.backend_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
                except Exception as e:  # the engine's own message is the useful part
                    raise ForerunError(f"the grammar engine (llguidance) cannot read this tokenizer: {e}") from None
            return self._engine_tokenizer


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (JSON text); not yet checked against a tokenizer.
    >>> json.loads(grammar_text(StructuredOutputs(regex="[0-9]+")))["grammars"][0]["lark_grammar"]
    'start: /[0-9]+/'
    """
    import llguidance

    kind = spec.kind
    try:
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec.grammar)  # Lark as is, GBNF / EBNF converted
        schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
        if spec.disable_additional_properties:
            schema = closed(schema)
        options = {"whitespace_flexible": spec.whitespace_flexible, "lenient": False, "coerce_one_of": False}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise FieldError(spec.field, f"the grammar engine cannot read it: {e}") from None


def refusal(spec: StructuredOutputs, message: str) -> FieldError:
    """The engine's complaint as a FieldError on spec.field, naming unenforced keywords.
    >>> refusal(StructuredOutputs(json={}), 'Unimplemented keys: ["uniqueItems", "not"]').keywords
    ('uniqueItems', 'not')
    >>> str(refusal(StructuredOutputs(regex="x"), 'NoExtensionBias\\n<state>'))
    'structured_outputs.regex: matches no text'
    """
    field = spec.field
    if keys := re.match(r"Unimplemented keys: (\[.*?\])", message):
        names = tuple(json.loads(keys.group(1)))
        listed = ", ".join(repr(n) for n in names)
        return UnenforcedKeyword(field, names, f"JSON schema keyword {listed} is not enforced by forerun's grammar "
                                               "engine (llguidance); remove it or express it another way")
    if fmt := re.match(r"Unknown format: (.*)", message):
        return UnenforcedKeyword(field, ("format",), f"JSON schema keyword 'format' with value {fmt.group(1)!r} is "
                                                     "not enforced by forerun's grammar engine; remove it or use a pattern")
    if message.startswith("oneOf constraints are not supported"):
        return UnenforcedKeyword(field, ("oneOf",), "JSON schema keyword 'oneOf' is enforced only where its branches "
                                                    "cannot overlap; these can: use anyOf")
    if message.startswith(("NoExtension", "Unsatisfiable schema")):
        why = message.split("\n", 1)[0]
        return FieldError(field, "matches no text" + (f" ({why})" if why.startswith("Unsatisfiable") else ""))
    return FieldError(field, _first_reason(message, keep_location=spec.kind == "grammar"))


def _first_reason(message: str, keep_location: bool) -> str:
    """The line of an engine message that says why, without its state dump.
    >>> _first_reason('at 1(8): invalid regex "a(" (in regex): regex parse error:\\n  a(\\nerror: unclosed group', False)
    'invalid regex "a(": unclosed group'
    """
    lines = message.split("\n<state>", 1)[0].splitlines()
    head = lines[0].strip() if lines else "rejected"
    if not keep_location:
        head = re.sub(r"^at \d+\(\d+\): ", "", head)
    detail = next((line.strip()[len("error:"):].strip() for line in lines[1:] if line.strip().startswith("error:")), "")
    if detail:
        head = f"{head.split(' (in ', 1)[0]}: {detail}"
    return head


# Where a schema nests other schemas: maps of them, lists of them, or one.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems")


def closed(schema):
    """The schema with additionalProperties: false on every object schema that does not say
    (vLLM's disable_additional_properties); a copy, the input is not changed.
    >>> closed({"type": "object", "properties": {"a": {"type": "object"}}})
    {'type': 'object', 'properties': {'a': {'type': 'object', 'additionalProperties': False}}, 'additionalProperties': False}
    """
    if isinstance(schema, list):  # draft-07 tuple items
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in (*_LISTS, *_ONES):
        if key in out:
            out[key] = closed(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
