"""Compiling constraints with the grammar engine (llguidance, a declared dependency: nothing here
skips): once per constraint and tokenizer, cached; refusals that name the field and, for a JSON
schema keyword the engine would not enforce, the keyword. Real tokenizer: the embedded SmolLM2's."""
import doctest
import subprocess
import sys

import pytest

from forerun.errors import FieldError
from forerun.structured import GrammarCompiler, StructuredOutputs, UnenforcedKeyword, from_request, grammar
from forerun.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(embedded_dir):
    return GrammarCompiler(Tokenizer.from_pretrained(embedded_dir))


def _fully_valid(compiler, spec, text: str) -> bool:
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return compiler.matcher(spec).check_draft(ids) == len(ids)


def test_doctests():
    assert doctest.testmod(grammar).failed == 0


def test_importing_forerun_does_not_import_the_grammar_engine():
    code = "import sys, forerun, forerun.structured; print('llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_constraint_is_compiled_once_and_then_served_from_the_cache(embedded_dir):
    compiler = GrammarCompiler(Tokenizer.from_pretrained(embedded_dir))
    first = compiler.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.compile(StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "integer"}}}',
                                               field="guided_json"))
    assert again is first and (compiler.hits, compiler.misses) == (1, 1)
    assert compiler.matcher(first.spec).consumed == 0 and compiler.hits == 2


def test_the_cache_keeps_the_most_recently_used(embedded_dir):
    compiler = GrammarCompiler(Tokenizer.from_pretrained(embedded_dir), cache_size=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    compiled_a = compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is compiled_a
    misses = compiler.misses
    compiler.compile(b)
    assert compiler.misses == misses + 1


def test_rows_get_independent_states(compiler):
    spec = StructuredOutputs(regex="(ab)+")
    one, two = compiler.matcher(spec), compiler.matcher(spec)
    assert one.advance(compiler.tokenizer.encode("ab", add_special_tokens=False)[0])
    assert one.consumed == 1 and two.consumed == 0 and not (one.mask() == two.mask()).all()


def test_json_is_compact_unless_whitespace_is_asked_for(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact, flexible = StructuredOutputs(json=schema), StructuredOutputs(json=schema, whitespace_flexible=True)
    assert _fully_valid(compiler, compact, '{"a":1}') and not _fully_valid(compiler, compact, '{"a": 1}')
    assert _fully_valid(compiler, flexible, '{"a": 1}') and _fully_valid(compiler, flexible, '{\n  "a":1}')
    patterned = StructuredOutputs(json=schema, whitespace_pattern="[ ]?")
    assert _fully_valid(compiler, patterned, '{ "a": 1 }') and not _fully_valid(compiler, patterned, '{\n"a":1}')


def test_additional_properties_are_closed_on_request(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _fully_valid(compiler, StructuredOutputs(json=schema), '{"a":1,"b":2}')
    assert not _fully_valid(compiler, StructuredOutputs(json=schema, disable_additional_properties=True), '{"a":1,"b":2}')
    assert _fully_valid(compiler, StructuredOutputs(json=schema, disable_additional_properties=True), '{"a":1}')


def test_json_object_means_any_object(compiler):
    spec = StructuredOutputs(json_object=True)
    assert _fully_valid(compiler, spec, '{"x":[1,{"y":null}]}') and not _fully_valid(compiler, spec, '[1]')


def test_choice_and_gbnf_and_lark_grammars(compiler):
    assert _fully_valid(compiler, StructuredOutputs(choice=["red", "green"]), "green")
    assert not _fully_valid(compiler, StructuredOutputs(choice=["red", "green"]), "blue")
    gbnf = 'root ::= "yes" | "no"'
    assert _fully_valid(compiler, StructuredOutputs(grammar=gbnf), "no")
    lark = 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]+/'
    assert _fully_valid(compiler, StructuredOutputs(grammar=lark), "[1,22,3]")
    assert not _fully_valid(compiler, StructuredOutputs(grammar=lark), "[1,,3]")


@pytest.mark.parametrize("schema, keywords", [
    ({"type": "array", "uniqueItems": True}, ("uniqueItems",)),
    ({"not": {"type": "string"}}, ("not",)),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, ("if", "then")),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, ("dependentRequired",)),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, ("propertyNames",)),
    ({"type": "array", "contains": {"type": "integer"}}, ("contains",)),
    ({"type": "string", "format": "no-such-format"}, ("format",)),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ("oneOf",)),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, ("uniqueItems",)),
])
def test_a_keyword_the_engine_would_not_enforce_is_refused_by_name(compiler, schema, keywords):
    with pytest.raises(UnenforcedKeyword) as caught:
        compiler.compile(StructuredOutputs(json=schema, field="response_format.json_schema.schema"))
    assert caught.value.keywords == keywords and caught.value.field == "response_format.json_schema.schema"
    assert all(f"'{k}'" in str(caught.value) for k in keywords)


def test_the_schema_cannot_switch_the_engine_to_lenient(compiler):
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    with pytest.raises(UnenforcedKeyword, match="uniqueItems"):
        compiler.compile(StructuredOutputs(json=schema))


@pytest.mark.parametrize("body, field, words", [
    ({"guided_regex": "[a&&b]"}, "guided_regex", "matches no text"),
    ({"guided_regex": "[0-9]{3}[^\\x00-\\U0010FFFF]"}, "guided_regex", "matches no text"),
    ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
    ({"guided_regex": "(?!a)b"}, "guided_regex", "look-around"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "strin"),
    ({"guided_json": {"$ref": "http://example.com/schema.json"}}, "guided_json", "example.com"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "matches no text"),
    ({"guided_json": {"enum": []}}, "guided_json", "matches no text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a&&b]"}}}},
     "response_format.json_schema.schema", "matches no text"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": "start: start \"a\""}, "guided_grammar", "matches no text"),
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar", "GBNF"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "'missing' not found"),
])
def test_a_constraint_the_engine_cannot_use_names_the_field(compiler, body, field, words):
    with pytest.raises(FieldError) as caught:
        compiler.compile(from_request(body))
    assert caught.value.field == field and words in str(caught.value)
    assert "<state>" not in str(caught.value)  # the engine's state dump stays out of the message
