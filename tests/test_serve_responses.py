"""OpenAI's Responses API (`POST /v1/responses`) through the openai client: text, streaming
events, function tools (a call and its output sent back as input items), structured output
(`text.format`), and 400s for what forerun cannot do (previous_response_id)."""
import json

import httpx
import pytest

from tests.test_serve_tools import WEATHER, server

openai = pytest.importorskip("openai")
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["function"]["parameters"]}
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from forerun.tokenizer import Tokenizer
    from tests.qwen_template import QWEN25_TEMPLATE
    from tests.tiny_tokenizer import tiny_tokenizer_dir

    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path_factory.mktemp("qwen"), QWEN25_TEMPLATE))
    with server(tok) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", http_client=httpx.Client(timeout=60)), s


def test_text_and_streamed_text_agree(client):
    c, _ = client
    r = c.responses.create(model="tiny", input="Say hello.", instructions="Be brief.", temperature=0, max_output_tokens=12)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens <= 12
    kinds, text, final = [], "", None
    for ev in c.responses.create(model="tiny", input="Say hello.", instructions="Be brief.", temperature=0,
                                 max_output_tokens=12, stream=True):
        kinds.append(ev.type)
        text += ev.delta if ev.type == "response.output_text.delta" else ""
        final = getattr(ev, "response", final)
    assert text == r.output_text == final.output_text and final.status == r.status
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds


def test_a_function_call_and_its_output_as_the_next_input(client):
    c, _ = client
    r = c.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], tool_choice="required", temperature=0,
                           parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = c.responses.create(model="tiny", tools=[TOOL], temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")
    with c.responses.stream(model="tiny", input="Weather in Paris?", tools=[TOOL], tool_choice="required", temperature=0,
                            parallel_tool_calls=False) as s:
        args = "".join(ev.delta for ev in s if ev.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments


def test_structured_output_by_text_format(client):
    c, _ = client
    r = c.responses.create(model="tiny", input="An item, please.", temperature=0,
                           text={"format": {"type": "json_schema", "name": "item", "schema": ITEM, "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"name", "ok"}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_what_forerun_cannot_do_is_a_400_naming_it(client, body, param):
    _, s = client
    with s.client() as h:
        r = h.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_cache_salt_keeps_a_tenants_cached_prefix_its_own(client):
    """vLLM's cache_salt, as on chat: the same input under another salt reads nothing cached."""
    c, _ = client
    text = "Summarise the weather report for Paris, Lyon and Nice in one short line, please. " * 3

    def cached(salt):
        r = c.responses.create(model="tiny", input=text, temperature=0, max_output_tokens=4, extra_body={"cache_salt": salt})
        return r.usage.input_tokens_details.cached_tokens

    cached("alice")
    assert cached("alice") > 0 and cached("bob") == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        c.responses.create(model="tiny", input=text, extra_body={"cache_salt": ""})
