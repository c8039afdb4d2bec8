"""API keys and tenants in the server: a missing or wrong key is a 401 (OpenAI's error shape),
probes stay open, and each key is a tenant whose cached prefixes and suffix-decoding history
serve its own requests only."""
import pytest

from forerun.config import SpeculativeConfig
from forerun.errors import ConfigError
from forerun.kernels import loader as kernel_loader
from forerun.serve.auth import ApiKeys
from forerun.serve.main import build_server
from forerun.serve.scheduler import ServeConfig
from tests.serve_util import NAME, Server, tiny_llm, wait_idle

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels (batch-invariant)")
TURN = [{"role": "system", "content": "You are terse. " * 4}, {"role": "user", "content": "Say something long."}]


def server(spec=None, keys=("alice-key", "bob-key")) -> Server:
    conf = ServeConfig(max_batch=2, max_len=256, block_size=8, batch_aware=False)
    return Server(build_server(tiny_llm("int8"), spec, conf, default_max_tokens=16, names=(NAME,),
                               keys=ApiKeys.of(list(keys), env="")))


def ask(client, key, **extra):
    r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"model": NAME, "messages": TURN, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_missing_or_wrong_key_is_a_401_and_probes_stay_open():
    with server() as s, s.client() as c:
        body = {"model": NAME, "messages": TURN, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "alice-key"}):
            r = c.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert c.get("/v1/models").status_code == 401
        assert c.post("/reset_prefix_cache").status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert ask(c, "bob-key")["choices"][0]["message"]["content"]
        assert 'forerun_requests_rejected_total{status="401"} 5.0' in c.get("/metrics").text


def test_the_openai_client_sends_its_key():
    openai = pytest.importorskip("openai")
    with server() as s:
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="alice-key")
        out = good.chat.completions.create(model=NAME, messages=TURN, max_tokens=3, temperature=0)
        assert out.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong").chat.completions.create(model=NAME, messages=TURN, max_tokens=3)


def test_keys_from_a_file_and_bad_keys_refused(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nalpha\n\n  beta  \n")
    keys = ApiKeys.of(files=[str(f)], env="")
    assert keys.tenant("Bearer alpha") and keys.tenant("Bearer beta") and keys.tenant("Bearer alpha") != keys.tenant("Bearer beta")
    assert keys.tenant("Bearer gamma") is None and keys.tenant(None) is None
    with pytest.raises(ConfigError, match="api-key-file"):
        ApiKeys.of(files=[str(tmp_path / "absent")], env="")
    with pytest.raises(ConfigError, match="empty"):
        ApiKeys.of(["  "], env="")
    (tmp_path / "none").write_text("# keys go here\n\n")  # a file without a key never turns the guard off
    with pytest.raises(ConfigError, match="no key in it"):
        ApiKeys.of(files=[str(tmp_path / "none")], env="")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00key\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        ApiKeys.of(files=[str(tmp_path / "binary")], env="")
    assert ApiKeys.of(env="").tenant(None) == b""  # no keys: one tenant, everyone in it


def test_a_tenants_prefix_blocks_serve_it_only():
    with server() as s, s.client() as c:
        ask(c, "alice-key")
        alice, bob = ask(c, "alice-key"), ask(c, "bob-key")
        assert alice["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert alice["choices"][0]["message"]["content"] == bob["choices"][0]["message"]["content"]


def test_suffix_drafts_come_from_the_tenants_own_earlier_outputs():
    spec = SpeculativeConfig("suffix", 8, options={"suffix_min_prob": 0.0})
    with server(spec) as s, server(None) as plain, s.client() as c, plain.client() as pc:
        reference = ask(pc, "alice-key")["choices"][0]["message"]["content"]
        first = ask(c, "alice-key")
        wait_idle(s.scheduler)
        again, other = ask(c, "alice-key"), ask(c, "bob-key")
        for out in (first, again, other):
            assert out["choices"][0]["message"]["content"] == reference
        store = s.scheduler.drafter.store
        alice, bob = ApiKeys.of(["alice-key"], env="").tenant("Bearer alice-key"), ApiKeys.of(["bob-key"], env="").tenant("Bearer bob-key")
        assert len(store) >= 2
        from forerun.serve.auth import salt

        assert len(store.hay(salt(alice, None))) > 2 * 40  # alice's two answers; bob's one is his alone
        assert len(store.hay(salt(bob, None))) == 41
        # alice's second answer is her first one again: drafted from it nearly whole; bob's first is not
        assert again["forerun"]["accepted"] > other["forerun"]["accepted"] and again["forerun"]["accepted"] >= 30, (again["forerun"], other["forerun"])


def test_a_draft_models_cached_blocks_serve_their_tenant_only():
    """The draft model's own prefix cache is scoped as the verifier's is: bob's prompt, the same
    text as alice's, reads none of the draft model's blocks that alice's requests left."""
    from forerun.llm import LLM
    from tests.serve_util import VOCAB
    from tests.tiny import tiny_model

    # (no tokenizer: the draft model's vocabulary is checked by its width)
    draft = LLM(tiny_model(seed=1, dtype="int4", vocab_size=VOCAB, hidden_size=64, intermediate_size=128), dtype="int4")
    spec = SpeculativeConfig("draft_model", 3, draft_model=draft)
    with server(spec) as s, s.client() as c:
        pool = draft.prefix_cache
        ask(c, "alice-key")
        wait_idle(s.scheduler)
        assert pool.stats.stored > 0  # alice's K/V in the draft model's pool
        hit = pool.stats.hit
        ask(c, "alice-key")
        wait_idle(s.scheduler)
        assert pool.stats.hit > hit  # her own blocks read again
        hit = pool.stats.hit
        ask(c, "bob-key")
        assert pool.stats.hit == hit  # none of hers for bob
        wait_idle(s.scheduler)
        assert pool.blocks
        assert c.post("/reset_prefix_cache", headers={"Authorization": "Bearer alice-key"}).status_code == 200
        assert not pool.blocks and pool.used_bytes == 0  # the reset empties the draft model's pool too
