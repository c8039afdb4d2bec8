"""Tool calls through the server, on a tiny random model with Qwen2.5's chat template: under
tool_choice required or a named function the answer is a well-formed call of a given tool
(OpenAI's tool_calls, finish_reason tool_calls), streamed as OpenAI streams it; speculative
rows answer as plain ones; a tool loop's second turn (content null + tool_calls, then a
`tool` message) renders as the model wrote it; "auto" constrains only once a call opens;
bad requests are 400s naming the field."""
import json

import httpx
import pytest
import torch

from forerun.config import SpeculativeConfig
from forerun.llm import LLM
from forerun.serve.main import build_server
from forerun.serve.scheduler import ServeConfig
from forerun.structured.lazy import TriggeredGrammar
from forerun.structured.spec import StructuredOutputs
from forerun.structured.tools import Tool, grammar
from forerun.tokenizer import Tokenizer
from tests.qwen_template import QWEN25_TEMPLATE
from tests.serve_util import Server
from tests.test_serve_structured import CHATML
from tests.tiny import tiny_model
from tests.tiny_tokenizer import tiny_tokenizer_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                                           "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path_factory.mktemp("qwen"), QWEN25_TEMPLATE))


def server(tok, spec=None) -> Server:
    model = tiny_model(seed=0, dtype="float32", vocab_size=tok.vocab_size, logit_scale=2.0, max_position_embeddings=2048)
    llm = LLM(model, dtype="float32", tokenizer=tok)
    conf = ServeConfig(max_batch=4, max_len=2048, block_size=16, batch_aware=False)
    return Server(build_server(llm, spec, conf, default_max_tokens=96, names=("tiny",)))


@pytest.fixture(scope="module")
def servers(tok):
    with server(tok) as plain, server(tok, SpeculativeConfig("suffix", 6, options={"suffix_min_prob": 0.0})) as spec:
        yield plain, spec


def chat(s: Server, status=200, **body) -> dict:
    with s.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "temperature": 0, **body})
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_call_is_well_formed_and_speculation_changes_nothing(servers, choice):
    plain, spec = servers
    a = chat(plain, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False)
    b = chat(spec, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False)
    msg = a["choices"][0]["message"]
    assert a["choices"][0]["finish_reason"] == "tool_calls" and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_time" and args["zone"] in ("utc", "cet")
    else:
        assert call["function"]["name"] in ("get_weather", "get_time") and set(args) in ({"city"}, {"zone"})
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert [c["function"] for c in b["choices"][0]["message"]["tool_calls"]] == [c["function"] for c in msg["tool_calls"]]
    assert b["forerun"]["drafted"] >= 0


def test_a_named_function_is_called_once(servers):
    plain, _ = servers
    out = chat(plain, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               max_tokens=300)
    calls = out["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    from forerun.serve.chat_turn import chat_turn
    from forerun.serve.schemas import ChatRequest

    llm = plain.app.state.llm
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert not chat_turn(llm, ChatRequest(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named)).parallel
    assert chat_turn(llm, ChatRequest(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")).parallel


def test_parallel_calls_may_follow_one_another(servers):
    plain, _ = servers
    out = chat(plain, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200)
    calls = out["choices"][0]["message"].get("tool_calls") or []
    assert out["choices"][0]["finish_reason"] in ("tool_calls", "length") and (calls or out["choices"][0]["finish_reason"] == "length")
    for c in calls:
        json.loads(c["function"]["arguments"])


def test_streamed_call_deltas_join_to_the_final_arguments(servers):
    plain, _ = servers
    whole = chat(plain, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)["choices"][0]["message"]
    with plain.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "temperature": 0, "stream": True, "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert "".join(d["function"]["arguments"] for d in deltas) == whole["tool_calls"][0]["function"]["arguments"]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks).count("<tool_call>")


def test_the_second_turn_of_a_tool_loop_renders_as_the_model_wrote_it(servers, tok):
    plain, _ = servers
    reply = chat(plain, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    first, first_usage = reply["choices"][0]["message"], reply["usage"]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
                     {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny, 21 C"}]
    second = chat(plain, messages=history, tools=[WEATHER])
    assert second["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    # the history's call renders to exactly the text the model emitted for it
    args = json.loads(first["tool_calls"][0]["function"]["arguments"])
    emitted = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
    rendered = plain.app.state.llm.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}}]}], tools=[WEATHER])
    assert emitted in rendered and "<tool_response>\nsunny, 21 C\n</tool_response>" in plain.app.state.llm.apply_chat_template(
        [{"role": "tool", "content": "sunny, 21 C"}], tools=[WEATHER])
    # and the second turn reads the first turn's blocks (its prompt at least: whole blocks of 16)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_usage["prompt_tokens"] - 16


def test_auto_is_free_text_until_a_call_opens(tok):
    """LazyMatcher: every token allowed before <tool_call>; after it, only a well-formed call."""
    llm = LLM(tiny_model(seed=0, dtype="float32", vocab_size=tok.vocab_size), dtype="float32", tokenizer=tok)
    trigger = tok.encode("<tool_call>", add_special_tokens=False)[0]
    lazy = TriggeredGrammar(llm.compile_grammar(StructuredOutputs(
        grammar=grammar([Tool.of(WEATHER, "tools[0]")], parallel=False, after_open=True, marks=(trigger, trigger + 1)), field="tools")), trigger).matcher()
    free = tok.encode("Let me check. ", add_special_tokens=False)
    assert lazy.check_draft(free) == len(free) and bool(lazy.mask(tok.vocab_size).all()) and lazy.forced(5) == []
    call = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', add_special_tokens=False)
    assert lazy.check_draft(free + call) == len(free + call)
    for t in free + call[:1]:
        assert lazy.advance(t)
    assert not bool(lazy.mask(tok.vocab_size).all())  # constrained from here
    assert tok.decode(lazy.forced(40)).startswith('\n{"name": "get_weather", "arguments": {"city": ')
    masks = lazy.draft_masks(call[1:5], tok.vocab_size)
    assert masks.shape == (5, tok.vocab_size) and torch.all(masks.sum(-1) >= 1)
    lazy.rollback(2)  # back over the trigger: free again
    assert lazy.row is None and bool(lazy.mask(tok.vocab_size).all())
    wrong = tok.encode('<tool_call>\n{"name": "nope"', add_special_tokens=False)
    assert lazy.check_draft(wrong) == wrong.index(tok.encode("n", add_special_tokens=False)[0], 6)  # no tool "n..."


def test_auto_answers_and_equals_speculation(servers):
    plain, spec = servers
    a, b = (chat(s, tools=[WEATHER], max_tokens=40)["choices"][0] for s in (plain, spec))
    assert a["message"]["content"] == b["message"]["content"] and a["finish_reason"] == b["finish_reason"]
    calls = [[c["function"] for c in x["message"].get("tool_calls") or []] for x in (a, b)]
    assert calls[0] == calls[1]


BAD = [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[WEATHER], messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_tool_requests_are_400s_naming_the_field(servers, body, field):
    plain, _ = servers
    assert chat(plain, status=400, **body)["error"]["param"] == field


def test_a_template_without_tools_is_a_clear_400(tmp_path):
    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path, CHATML))
    with server(tok) as s:
        err = chat(s, status=400, tools=[WEATHER])["error"]
        assert err["param"] == "tools" and "template" in err["message"]


def test_the_openai_client_calls_a_tool(servers):
    openai = pytest.importorskip("openai")
    plain, _ = servers
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", http_client=httpx.Client(timeout=30))
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
