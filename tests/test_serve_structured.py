"""Structured outputs through the server: OpenAI's response_format (json_schema, json_object),
vLLM's structured_outputs and guided_* fields, streamed or not, with the openai client's
`chat.completions.parse`; speculative rows give plain decoding's text; constrained and free
rows share a step and answer as they do alone; a bad constraint is a 400 naming its field."""
import concurrent.futures
import json
import re

import httpx
import pytest

from forerun.config import SpeculativeConfig
from forerun.llm import LLM
from forerun.serve.main import build_server
from forerun.serve.scheduler import ServeConfig
from forerun.tokenizer import Tokenizer
from tests.serve_util import Server
from tests.tiny import tiny_model
from tests.tiny_tokenizer import tiny_tokenizer_dir

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me an item."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"), CHATML))


def server(tok, spec=None) -> Server:
    llm = LLM(tiny_model(seed=0, dtype="float32", vocab_size=tok.vocab_size, logit_scale=2.0), dtype="float32", tokenizer=tok)
    conf = ServeConfig(max_batch=4, max_len=256, block_size=8, batch_aware=False)
    return Server(build_server(llm, spec, conf, default_max_tokens=48, names=("tiny",)))


@pytest.fixture(scope="module")
def servers(tok):
    with server(tok) as plain, server(tok, SpeculativeConfig("ngram", 4, ngram_min=1)) as spec:
        yield plain, spec


def chat(s: Server, **body) -> dict:
    with s.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def content(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
FORMS = {
    "json_schema": {"response_format": SCHEMA},
    "json_object": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"regex": "[a-d]{3}-[0-9]{2}"}},
    "guided_choice": {"guided_choice": ["alpha", "beta"]},
    "guided_json": {"guided_json": ITEM},
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_spelling_constrains_and_speculation_changes_nothing(servers, form):
    plain, spec = servers
    a, b = chat(plain, **FORMS[form]), chat(spec, **FORMS[form])
    assert content(a) == content(b)
    text, finish = content(a), a["choices"][0]["finish_reason"]
    assert finish == "stop" or form == "json_object"  # (any object: a random model's keys may run to the limit)
    if form in ("json_schema", "guided_json"):
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    elif form == "json_object":
        assert text.startswith('{"') and (finish == "length" or isinstance(json.loads(text), dict))
    elif form == "structured_outputs":
        assert re.fullmatch("[a-d]{3}-[0-9]{2}", text)
    else:
        assert text in ("alpha", "beta")
    if form != "guided_choice":
        assert b["forerun"]["drafted"] >= 0  # (the speculation summary is there)


def test_streamed_deltas_join_to_the_constrained_answer(servers):
    plain, _ = servers
    with plain.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "temperature": 0, "stream": True, "response_format": SCHEMA}) as r:
        parts = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                 for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(parts) == content(chat(plain, response_format=SCHEMA))


def test_constrained_and_free_rows_share_a_step_and_answer_as_alone(servers):
    _, spec = servers
    alone = [content(chat(spec, **FORMS[f])) for f in FORMS] + [content(chat(spec, max_tokens=20))]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(chat, spec, **FORMS[f]) for f in FORMS] + [pool.submit(chat, spec, max_tokens=20)]
        together = [content(j.result()) for j in jobs]
    assert together == alone


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_regex": "[a&&b]"}, "guided_regex"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_a_bad_constraint_is_a_400_naming_its_field(servers, body, field):
    plain, _ = servers
    with plain.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_the_openai_client_parses_into_a_pydantic_model(servers):
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        ok: bool

    plain, _ = servers
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", http_client=httpx.Client(timeout=30))
    out = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Item, temperature=0)
    item = out.choices[0].message.parsed
    assert isinstance(item, Item) and len(item.name) <= 6
