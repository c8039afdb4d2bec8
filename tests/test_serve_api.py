"""The HTTP API on loopback: the official openai client (plain and streaming), per-request
speculation, /v1/models, /health, /metrics, and 4xx JSON errors for bad requests."""
import json

import openai
import pytest

from tests.serve_util import NAME, tiny_server


@pytest.fixture(scope="module")
def server():
    with tiny_server(k=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_completions_and_chat(client):
    out = client.completions.create(model=NAME, prompt="abcabcabcab", max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 12
    assert out.usage.prompt_tokens == 11
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert [m.id for m in client.models.list().data] == [NAME]


def test_openai_client_streams_the_same_text(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "123123123"}], max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens >= 1
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    text = "".join(c.choices[0].text for c in client.completions.create(model=NAME, prompt="xyxyxy", max_tokens=10, temperature=0, stream=True))
    assert text == client.completions.create(model=NAME, prompt="xyxyxy", max_tokens=10, temperature=0).choices[0].text


def test_sse_framing_ends_with_done(server):
    with server.client() as c, c.stream("POST", "/v1/completions", json={"prompt": "aaaa", "max_tokens": 5, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_speculation_per_request_including_off(client):
    kw = dict(model=NAME, prompt="121212121212", max_tokens=24, temperature=0)
    on = client.completions.create(**kw).model_extra["forerun"]
    off = client.completions.create(extra_body={"speculative": {"method": "none"}}, **kw)
    k1 = client.completions.create(extra_body={"speculative": {"k": 1}}, **kw)
    assert off.model_extra["forerun"]["drafted"] == 0 and on["drafted"] > 0
    assert k1.model_extra["forerun"]["drafted"] <= k1.model_extra["forerun"]["verifier_forwards"]
    assert off.choices[0].text == client.completions.create(**kw).choices[0].text == k1.choices[0].text  # greedy: exact
    assert on["prefill_s"] > 0 and on["decode_s"] > 0  # the server's own clock (bench/structured.py reads it)


def test_stop_strings_are_cut(server):
    with server.client() as c:
        full = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30, "temperature": 0}).json()["choices"][0]["text"]
        stop = full[5:7]
        cut = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30, "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and stop not in cut["choices"][0]["text"]
    assert full.startswith(cut["choices"][0]["text"])


BAD = [
    ({"prompt": "x", "frobnicate": 1}, 400),  # unknown field
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "temperature": 1e9}, 400),
    ({"prompt": "x", "top_p": 0}, 400),
    ({"prompt": "x", "top_k": -5}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "max_tokens": 10**6}, 400),  # beyond the context
    ({"prompt": "x" * 300}, 400),  # prompt over the context (256)
    ({"prompt": [1000]}, 400),  # token id outside the vocabulary
    ({"prompt": "x", "n": 17}, 400),
    ({"prompt": "x", "seed": -1}, 400),
    ({"prompt": "x", "stop": ["a"] * 9}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": ["a", "b"]}, 400),
    ({"prompt": "x", "model": "gpt-4"}, 404),
    ({"prompt": "x", "speculative": {"method": "eagle"}}, 400),
    ({"prompt": "x", "speculative": {"k": -1}}, 400),
    ({"prompt": "x", "frequency_penalty": False}, 400),  # False == 0, but not a number (found by the fuzz test)
    ({"prompt": "x", "presence_penalty": 2.5}, 400),  # outside OpenAI's [-2, 2]
    ({"prompt": "x", "repetition_penalty": 0}, 400),
    ({"prompt": "x", "repetition_penalty": 3.269336093310707e-268}, 400),  # 0 in float32: l / 0 (found by the fuzz test)
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, 400),  # past the vocabulary
    ({}, 400),
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_requests_get_json_4xx(server, body, status):
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert "message" in r.json()["error"]


def test_extreme_but_valid_sampling_values_are_served(server):
    with server.client() as c:
        for body in ({"top_p": 5e-324}, {"temperature": 1e-300}, {"temperature": 2.0, "top_k": 1}, {"top_k": 10**6}):
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, **body})
            assert r.status_code == 200, (body, r.text)


def test_malformed_json_and_bad_chat(server):
    with server.client() as c:
        assert c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
        assert c.get("/v1/nothing").status_code == 404
        assert c.get("/health").json()["status"] == "ok"


def test_metrics_report_speculation(server, client):
    client.completions.create(model=NAME, prompt="5555555555", max_tokens=10, temperature=0)
    with server.client() as c:
        text = c.get("/metrics").text
    for name in ("forerun_requests_total", "forerun_generated_tokens_total", "forerun_queue_depth", "forerun_batch_size",
                 "forerun_drafted_tokens_total", "forerun_accepted_tokens_total", "forerun_acceptance_rate",
                 "forerun_mean_accepted_length", "forerun_step_seconds_bucket", "forerun_kv_blocks_used"):
        assert name in text, name
    assert 'forerun_position_drafted_total{position="1"}' in text


def test_malformed_json_says_what_is_wrong_and_where(server):
    with server.client() as c:
        r = c.post("/v1/completions", content=b'{"prompt": "x",\n "max_tokens": }', headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None, r.text
    assert err["message"] == "the body is not valid JSON: Expecting value at line 2, column 16 (character 31)"


def test_empty_prompts_are_refused(server):
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "  "}]})
        raw = c.post("/v1/completions", json={"prompt": ""})
    assert chat.status_code == 400 and chat.json()["error"]["message"] == "every message is empty: nothing to answer"
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"


def test_a_k_above_the_servers_is_clamped_and_said(client):  # the server's k is 4
    kw = dict(model=NAME, prompt="121212121212", max_tokens=12, temperature=0)
    clamped = client.completions.create(extra_body={"speculative": {"k": 9}}, **kw).model_extra["forerun"]
    assert clamped["notes"] == ["speculative.k 9 is above this server's k (4): clamped to 4"] and clamped["drafted"] > 0
    assert "notes" not in client.completions.create(extra_body={"speculative": {"k": 3}}, **kw).model_extra["forerun"]
    chunks = list(client.completions.create(stream=True, extra_body={"speculative": {"k": 9}}, **kw))
    assert chunks[-1].model_extra["forerun"]["notes"] == clamped["notes"]


def test_a_400_lists_every_problem_and_the_log_says_it(server, caplog):
    import httpx

    with caplog.at_level("WARNING", logger="forerun.serve"):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [], "temperature": 5, "top_p": 0})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and all(f in message for f in ("messages", "temperature", "top_p")), message
    assert any("temperature" in rec.getMessage() for rec in caplog.records)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                              "guided_regex": "a("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"  # the toy tokenizer: no grammar


def test_penalties_and_logit_bias_are_applied_and_openai_extras_accepted(server, caplog):
    with server.client() as c:
        ask = {"model": NAME, "prompt": "abcabc", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        plain = c.post("/v1/completions", json=ask).json()["choices"][0]["text"]
        banned = c.post("/v1/completions", json={**ask, "logit_bias": {str(ord(plain[0]) - 48): -100}}).json()
        assert banned["choices"][0]["text"][0] != plain[0]
        with caplog.at_level("WARNING", logger="forerun.serve"):
            r = c.post("/v1/completions", json={**ask, "frequency_penalty": 2, "presence_penalty": 1.5,
                                                "repetition_penalty": 1.3, "store": False, "metadata": {"a": "b"}})
        assert r.status_code == 200, r.text
        assert any("store" in rec.getMessage() and "metadata" in rec.getMessage() for rec in caplog.records)


def test_n_choices_are_the_seeded_requests_one_by_one(server):
    with server.client() as c:
        ask = {"model": NAME, "prompt": "abc", "max_tokens": 10, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        many = c.post("/v1/completions", json={**ask, "n": 3}).json()
        alone = [c.post("/v1/completions", json={**ask, "seed": 7 + i}).json()["choices"][0]["text"] for i in range(3)]
    assert [ch["index"] for ch in many["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in many["choices"]] == alone and len(set(alone)) > 1
    assert many["usage"]["completion_tokens"] == 30


def test_n_choices_stream_interleaved_each_with_its_index(server):
    """n > 1 streamed: one id, chunks carrying choice indexes 0..n-1 whose texts join to the
    non-streamed choices, one finish per choice, and the usage chunk counting every choice."""
    import json

    with server.client() as c:
        ask = {"model": NAME, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 10, "temperature": 1.0,
               "seed": 5, "ignore_eos": True, "n": 3}
        whole = c.post("/v1/chat/completions", json=ask).json()
        lines = c.post("/v1/chat/completions", json={**ask, "stream": True, "stream_options": {"include_usage": True}}).text
    chunks = [json.loads(line[6:]) for line in lines.splitlines() if line.startswith("data: {")]
    texts, finishes = {}, {}
    for ch in chunks:
        for choice in ch["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert len({ch["id"] for ch in chunks}) == 1
    assert texts == {ch["index"]: ch["message"]["content"] for ch in whole["choices"]} and len(set(texts.values())) > 1
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30
    assert lines.rstrip().endswith("data: [DONE]")


def test_a_one_token_answer_comes_from_the_prefill_without_a_step():
    """The first token is sampled from the prompt's last logits in the prefill (as LLM does, the
    same draws for a seed): a max_tokens=1 request takes no decoding step."""
    from forerun.config import SamplingParams
    from tests.serve_util import tiny_llm

    llm = tiny_llm()
    with tiny_server(k=4) as s, s.client() as c:
        for seed in (None, 0, 1, 2):
            body = {"prompt": "abcabcab", "max_tokens": 1, "temperature": 0 if seed is None else 1.0, "seed": seed}
            r = c.post("/v1/completions", json=body).json()
            want = llm.generate(["abcabcab"], SamplingParams(max_tokens=1, temperature=body["temperature"], seed=seed), speculative=None)[0]
            assert r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["completion_tokens"] == 1 and r["forerun"]["verifier_forwards"] == 0
        metrics = c.get("/metrics").text
    assert "forerun_steps_total 0.0" in metrics
