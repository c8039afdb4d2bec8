"""Logprobs through the server, in the shapes the openai client parses: chat's logprobs /
top_logprobs, completions' logprobs and echo (the prompt scored, max_tokens 0 allowed), streaming
included; the values are LLM.generate's (the verifier's), with and without speculation; bad
values are a 400 naming the field."""
import math

import openai
import pytest

from forerun.config import SamplingParams
from tests.serve_util import NAME, tiny_server


@pytest.fixture(scope="module")
def server():
    with tiny_server(k=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _llm(server):
    return server.app.state.llm


PROMPT = "121212121212"


def test_completion_logprobs_equal_the_apis_with_and_without_speculation(server, client):
    llm = _llm(server)
    (want,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=2), speculative=None)
    for extra in ({}, {"speculative": {"method": "none"}}):
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, extra_body=extra)
        lp = out.choices[0].logprobs
        assert lp.token_logprobs == [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)]
        assert lp.tokens == [llm.token_text(t) for t in want.token_ids]
        assert all(len(top) >= 2 and max(top.values()) >= tok for top, tok in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert out.model_extra["forerun"]["drafted"] == 0


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, client):
    """lm-eval's local-completions log-likelihood request: echo, max_tokens 1, logprobs 1, a
    token-id prompt; it reads token_logprobs[ctxlen:-1] and top_logprobs[ctxlen:-1]."""
    llm = _llm(server)
    ids = llm.encode(PROMPT)[0]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = llm.score_prompt(ids, 1)
    assert lp.token_logprobs[1 : len(ids)] == [e[t].logprob for e, t in zip(scored[1:], ids[1:])]
    assert out.choices[0].text.startswith(PROMPT)
    zero = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert zero.choices[0].text == PROMPT and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    greedy = [tok >= max(top.values()) for tok, top in zip(lp.token_logprobs[1:-1], lp.top_logprobs[1:-1])]
    assert greedy == [e[t].rank == 1 for e, t in zip(scored[1:], ids[1:])]  # lm-eval's is_greedy reads the top one


def test_the_echoed_prompt_is_scored_on_the_engine_thread(server, client, monkeypatch):
    """The one thread that runs the model (a second thread running torch's parallel work would
    give OpenMP a second pool and slow every step: serve/one_pool.py)."""
    import threading

    llm, seen = _llm(server), []
    score = llm.score_prompt

    def recorded(*args):
        seen.append(threading.current_thread().name)
        return score(*args)

    monkeypatch.setattr(llm, "score_prompt", recorded)
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert seen == ["forerun-engine"]


def test_chat_logprobs_and_top_logprobs(server, client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "1212"}], max_tokens=10, temperature=0)
    out = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy: top 1
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_streamed_completion_logprobs_are_the_whole_ones(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((x.token_logprobs for x in lps), []) == whole.logprobs.token_logprobs
    assert sum((x.text_offset for x in lps), []) == whole.logprobs.text_offset


def test_sampled_logprobs_are_the_chosen_tokens(client):
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3, logprobs=0)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
])
def test_bad_logprob_values_are_a_400_naming_the_field(server, path, body, field):
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_tokenizer_endpoints(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (what lm-eval's remote tokenizer reads)."""
    llm = _llm(server)
    with server.client() as c:
        tok = c.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert tok["tokens"] == llm.encode(PROMPT)[0] and tok["count"] == len(PROMPT) and tok["max_model_len"] == 256
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == llm.encode(llm.apply_chat_template([{"role": "user", "content": "hi"}]))[0]
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
        assert c.post("/detokenize", json={"tokens": [9999]}).status_code == 400
        assert c.post("/tokenize", json={}).status_code == 400
        assert c.post("/tokenize", json={"prompt": "x", "model": "gpt-4"}).status_code == 404
        assert c.get("/tokenizer_info").status_code == 404  # the toy tokenizer names no special tokens
