"""Structured-output constraints as requests spell them: the StructuredOutputs contract, the
OpenAI / vLLM field mappings, and a FieldError naming the field for every bad value. Pure: no
tokenizer, no grammar engine."""
import dataclasses
import doctest

import pytest

from forerun import errors
from forerun.errors import ConfigError, FieldError
from forerun.structured import request, spec
from forerun.structured import StructuredOutputs, from_request, from_response_format, from_structured_outputs


def test_doctests():
    for module in (spec, request, errors):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_field_error_is_a_config_error_and_a_value_error_carrying_the_field():
    e = FieldError("guided_regex", "matches no text")
    assert isinstance(e, ConfigError) and isinstance(e, ValueError)
    assert e.field == "guided_regex" and str(e) == "guided_regex: matches no text"


def test_each_kind_is_kept_in_a_hashable_canonical_form():
    assert StructuredOutputs(json='{"type": "string"}') == StructuredOutputs(json={"type": "string"})
    assert StructuredOutputs(json=True).json == "{}"  # any JSON value
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(grammar='root ::= "x"').kind == "grammar"
    specs = {StructuredOutputs(regex="a+"), StructuredOutputs(regex="a+", field="guided_regex")}
    assert len(specs) == 1  # where it came from does not change what it compiles to


def test_the_schema_keeps_its_key_order():
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}
    assert StructuredOutputs(json=schema).json.index("zeta") < StructuredOutputs(json=schema).json.index("alpha")


def test_json_is_compact_by_default():
    assert StructuredOutputs(json={}).whitespace_flexible is False


def test_the_contract_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StructuredOutputs(regex="a").regex = "b"


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, "structured_outputs", "got none"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs", "got regex and choice"),
    ({"json": "{nope"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "a JSON schema is an object"),
    ({"json": False}, "structured_outputs.json", "matches nothing"),
    ({"regex": ""}, "structured_outputs.regex", "is empty"),
    ({"regex": 3}, "structured_outputs.regex", "must be a string"),
    ({"grammar": ""}, "structured_outputs.grammar", "is empty"),
    ({"choice": []}, "structured_outputs.choice", "empty list"),
    ({"choice": "yes"}, "structured_outputs.choice", "must be a list of strings"),
    ({"choice": ["a", 3]}, "structured_outputs.choice[1]", "must be a string"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "must be true or false"),
    ({"json": {}, "whitespace_flexible": "no"}, "structured_outputs.whitespace_flexible", "must be true or false"),
    ({"regex": "a", "whitespace_flexible": True}, "structured_outputs.whitespace_flexible", "json and json_object only"),
    ({"choice": ["a"], "disable_additional_properties": True}, "structured_outputs.disable_additional_properties",
     "json and json_object only"),
    ({"grammar": "start: /a/", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "json"),
    ({"json": {}, "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern", "is empty"),
])
def test_a_bad_constraint_names_its_field(kwargs, field, words):
    with pytest.raises(FieldError) as caught:
        StructuredOutputs(**kwargs)
    assert caught.value.field == field and words in str(caught.value)
    assert str(caught.value).startswith(f"{field}: ")


def test_openai_response_formats():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).json_object is True
    spec = from_response_format({"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    assert spec.kind == "json" and spec.field == "response_format.json_schema.schema"
    assert spec == StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.mark.parametrize("value, field", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": "{bad"}}, "response_format.json_schema.schema"),
])
def test_a_bad_response_format_names_its_field(value, field):
    with pytest.raises(FieldError) as caught:
        from_response_format(value)
    assert caught.value.field == field


def test_vllm_structured_outputs_map_field_by_field():
    assert from_structured_outputs(None) is None
    spec = from_structured_outputs({"json": {"type": "object"}, "disable_any_whitespace": True,
                                    "disable_additional_properties": True, "disable_fallback": False,
                                    "whitespace_pattern": None, "regex": None, "structural_tag": None})
    assert spec.kind == "json" and spec.disable_additional_properties and not spec.whitespace_flexible
    assert spec.field == "structured_outputs.json"
    assert from_structured_outputs({"grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    assert from_structured_outputs({"choice": ["x", "y"]}).choice == ("x", "y")
    assert from_structured_outputs({"json_object": True}).json_object
    assert from_structured_outputs({"json": {}, "whitespace_flexible": True}).whitespace_flexible
    assert from_structured_outputs({"json": {}, "whitespace_pattern": "[ ]?"}).whitespace_pattern == "[ ]?"


@pytest.mark.parametrize("value, field", [
    (["json"], "structured_outputs"),
    ({"json": {}, "strict": True}, "structured_outputs.strict"),
    ({"regex": "a", "structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
    ({"json": {}, "regex": "a"}, "structured_outputs"),
    ({"choice": [""]}, "structured_outputs.choice[0]"),
    ({"regex": "a", "whitespace_flexible": True}, "structured_outputs.whitespace_flexible"),
])
def test_bad_vllm_structured_outputs_name_their_field(value, field):
    with pytest.raises(FieldError) as caught:
        from_structured_outputs(value)
    assert caught.value.field == field


def test_vllm_guided_fields_map_one_to_one():
    assert from_request({"model": "m", "messages": []}) is None
    assert from_request({"guided_json": {"type": "string"}}).json == '{"type":"string"}'
    assert from_request({"guided_regex": "[0-9]+"}).regex == "[0-9]+"
    assert from_request({"guided_choice": ["a", "b"]}).choice == ("a", "b")
    assert from_request({"guided_grammar": "start: /x/"}).grammar == "start: /x/"
    spec = from_request({"guided_json": {}, "guided_whitespace_pattern": " *", "guided_decoding_backend": "guidance"})
    assert spec.whitespace_pattern == " *" and spec.field == "guided_json"
    assert from_request({"response_format": {"type": "json_object"}}).json_object
    assert from_request({"structured_outputs": {"regex": "a"}}).field == "structured_outputs.regex"


@pytest.mark.parametrize("body, field, words", [
    ({"guided_choice": []}, "guided_choice", "empty list"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"guided_json": "{x"}, "guided_json", "not valid JSON"),
    ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json", "also sets response_format"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "guided_choice", "also sets structured_outputs"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json only"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
])
def test_a_bad_request_names_its_field(body, field, words):
    with pytest.raises(FieldError) as caught:
        from_request(body)
    assert caught.value.field == field and words in str(caught.value)
