"""Prefix caching in the server: a chat's later turn reads the earlier turn's blocks (the
prompt and the answer it resends), its output equals a server without the cache, the
response's usage says how many prompt tokens were cached (OpenAI's
prompt_tokens_details.cached_tokens), /metrics counts queried, hit and evicted tokens,
POST /reset_prefix_cache empties it, and a tenant's cache_salt keeps its blocks its own."""
import pytest

from forerun.kernels import loader as kernel_loader
from tests.serve_util import tiny_server, wait_idle

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels (batch-invariant)")
HISTORY = "You are a careful assistant. " * 2 + "Here is a file:\n" + "def f(x):\n    return x * 2\n" * 2


def chat(client, messages, **extra):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 24,
                                                   "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def session(client, **extra):
    """Two turns: the second resends the first answer and adds a message."""
    turn1 = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "What does f do?"}]
    answer, usage1 = chat(client, turn1, **extra)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And f(3)?"}]
    second, usage2 = chat(client, turn2, **extra)
    return (answer, second), (usage1, usage2)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "rows"])
def test_a_later_turn_hits_and_answers_as_without_the_cache(paged):
    with tiny_server("int8", paged=paged) as warm, tiny_server("int8", paged=paged, prefix_cache=False) as cold:
        with warm.client() as wc, cold.client() as cc:
            hot, hot_usage = session(wc)
            ref, ref_usage = session(cc)
            assert hot == ref
            assert hot_usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
            cached = hot_usage[1]["prompt_tokens_details"]["cached_tokens"]
            # all turn 1 computed, to the token: its prompt and the answer resent but the answer's
            # last token (no step wrote its K/V); the blocks are of 8 tokens, so a tail is read too
            assert cached == hot_usage[0]["prompt_tokens"] + hot_usage[0]["completion_tokens"] - 1 and cached % 8
            assert ref_usage[1]["prompt_tokens_details"]["cached_tokens"] == 0
            metrics = wc.get("/metrics").text
            assert f"forerun_prefix_cache_hit_tokens_total {float(cached)}" in metrics
            assert "forerun_prefix_cache_queried_tokens_total" in metrics
            wait_idle(warm.scheduler)
            assert warm.scheduler.blocks.used == 0  # cached blocks live apart from the rows' pool
            r = wc.post("/reset_prefix_cache")
            assert r.status_code == 200 and r.json()["reset_blocks"] > 0
            _, usage = session(wc)
            assert usage[1]["prompt_tokens_details"]["cached_tokens"] == cached  # rebuilt by turn 1 again


def test_a_tenants_blocks_are_never_read_by_another():
    with tiny_server("int8") as s, s.client() as c:
        session(c, cache_salt="alice")
        turn1 = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "What does f do?"}]
        _, alice = chat(c, turn1, cache_salt="alice")
        _, bob = chat(c, turn1, cache_salt="bob")
        _, nobody = chat(c, turn1)
        assert alice["prompt_tokens_details"]["cached_tokens"] > 0
        assert bob["prompt_tokens_details"]["cached_tokens"] == 0 and nobody["prompt_tokens_details"]["cached_tokens"] == 0
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": turn1, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt" in r.text


def test_off_where_asked_and_by_default_where_hits_could_change_tokens():
    with tiny_server("float64") as s:  # torch's kernels: not batch-invariant, so off by default
        assert s.scheduler.prefix is None
    with tiny_server("int8", prefix_cache=False) as s:
        assert s.scheduler.prefix is None
