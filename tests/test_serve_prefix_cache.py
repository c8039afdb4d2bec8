"""Prefix caching in the server: a chat's later turn reads the earlier turn's blocks (the
prompt and the answer it resends), its output equals a server without the cache, the
response's usage says how many prompt tokens were cached (OpenAI's
prompt_tokens_details.cached_tokens), /metrics counts queried, hit and evicted tokens,
POST /reset_prefix_cache empties it, and a tenant's cache_salt keeps its blocks its own."""
import warnings

import pytest

from forerun.kernels import loader as kernel_loader
from tests.serve_util import tiny_server, wait_idle

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels (batch-invariant)")
HISTORY = "You are a careful assistant. " * 2 + "Here is a file:\n" + "def f(x):\n    return x * 2\n" * 2


def ask(client, messages, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 24,
                                                   "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def chat(client, messages, **extra):
    body = ask(client, messages, **extra)
    return body["choices"][0]["message"]["content"], body["usage"]


def session_bodies(client, **extra) -> tuple[dict, dict]:
    """Two turns: the second resends the first answer and adds a message."""
    turn1 = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "What does f do?"}]
    first = ask(client, turn1, **extra)
    answer = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And f(3)?"}]
    return first, ask(client, turn2, **extra)


def session(client, **extra):
    bodies = session_bodies(client, **extra)
    return tuple(b["choices"][0]["message"]["content"] for b in bodies), tuple(b["usage"] for b in bodies)


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
            queried = sum(u["prompt_tokens"] - 1 for u in hot_usage)  # every prompt but its last token
            assert f"forerun_prefix_cache_queried_tokens_total {float(queried)}" in metrics
            assert "forerun_prefix_cache_evicted_tokens_total 0.0" in metrics  # 1 GB holds it all
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


@pytest.mark.parametrize("kv_cache", ["auto", "float16"])
def test_seeded_sampling_after_a_hit_draws_what_a_cold_server_draws(kv_cache):
    """A fixed k, prompt lookup (a drafter without history) and batch-aware k off: the draws
    follow the same drafts warm and cold, so a seeded request's tokens and its logprobs (the
    logits, compared as exact floats) are the cold server's; on the float16 cache too."""
    extra = {"temperature": 0.9, "seed": 11, "logprobs": True, "top_logprobs": 3}
    with tiny_server("int8", kv_cache=kv_cache) as warm, tiny_server("int8", kv_cache=kv_cache, prefix_cache=False) as cold:
        with warm.client() as wc, cold.client() as cc:
            hot, ref = session_bodies(wc, **extra), session_bodies(cc, **extra)
    assert hot[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the mechanism ran
    assert ref[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for h, r in zip(hot, ref):
        assert h["choices"][0]["message"] == r["choices"][0]["message"]
        assert h["choices"][0]["logprobs"] == r["choices"][0]["logprobs"] and h["choices"][0]["logprobs"]["content"]


def test_evictions_are_counted_and_the_answers_stay_the_cold_ones():
    from forerun.serve.scheduler import kv_bytes_per_token
    from tests.serve_util import tiny_llm

    block_gb = kv_bytes_per_token(tiny_llm("int8").model) * 8 / 2**30  # one 8-token block of K and V
    with tiny_server("int8", prefix_cache_gb=4 * block_gb) as small, tiny_server("int8", prefix_cache=False) as cold:
        with small.client() as sc, cold.client() as cc:
            for salt in ("a", "b"):  # the second session's blocks push the first's out
                assert session(sc, cache_salt=salt)[0] == session(cc)[0]
            metrics = sc.get("/metrics").text
    evicted = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("forerun_prefix_cache_evicted_tokens_total"))
    assert evicted > 0 and small.scheduler.prefix.used_bytes <= small.scheduler.prefix.max_bytes


def test_a_request_arriving_while_another_decodes_reads_its_prompt():
    """Blocks are kept when a prompt's prefill completes, not only when its request ends: a
    concurrent request with the same opening reads them while the first still decodes."""
    turn = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "What does f do?"}]
    with tiny_server("int8") as warm, tiny_server("int8", prefix_cache=False) as cold:
        with warm.client() as wc, cold.client() as cc:
            with wc.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": turn, "max_tokens": 100,
                                                                  "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # the long request is decoding
                other = turn[:1] + [{"role": "user", "content": "And f(3)?"}]
                body = ask(wc, other)
                assert warm.scheduler.running  # the first has not finished
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert body["choices"][0]["message"] == ask(cc, other)["choices"][0]["message"]



def test_the_flags_turn_it_off_or_opt_in_at_any_precision(capsys):
    from forerun import cli
    from forerun.serve.main import prefix_choice

    p = cli.build_parser()
    assert prefix_choice(p.parse_args(["serve"])) is None  # on where a hit never changes a token
    assert prefix_choice(p.parse_args(["serve", "--no-prefix-cache"])) is False
    assert prefix_choice(p.parse_args(["serve", "--enable-prefix-caching"])) is True
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--no-prefix-cache", "--enable-prefix-caching"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match="a cache hit may change tokens"), tiny_server("float64", prefix_cache=True) as s:
        assert s.scheduler.prefix is not None  # opted in where hits are not bit-stable: said so
    # `forerun serve --enable-prefix-caching` builds its LLM with the same choice: said once, not twice
    from tests.serve_util import tiny_llm

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        llm = tiny_llm("float64", enable_prefix_caching=True)
        with tiny_server("float64", k=0, llm=llm, prefix_cache=True) as s:
            assert s.scheduler.prefix is not None and llm.prefix_cache is not None
    assert [str(w.message)[:30] for w in said if issubclass(w.category, RuntimeWarning)] == [
        "prefix caching at float64 on c"]


def test_an_eagle_server_hits_and_drafts_as_without_the_cache():
    """The server's prefix cache with a head drafter (EAGLE reads the verifier's hidden states):
    a later turn reads turn 1's blocks and their hidden states, and answers and drafts as a
    server without the cache."""
    from forerun.config import SpeculativeConfig
    from tests.serve_util import tiny_llm
    from tests.test_prefix_cache import _random_head

    head = _random_head("eagle", tiny_llm("float32"))
    spec = lambda: SpeculativeConfig("eagle", 3, draft_model=head)  # noqa: E731
    with tiny_server("float32", spec=spec()) as warm, tiny_server("float32", spec=spec(), prefix_cache=False) as cold:
        with warm.client() as wc, cold.client() as cc:
            hot, ref = session_bodies(wc), session_bodies(cc)
    assert hot[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for h, r in zip(hot, ref):
        assert h["choices"][0]["message"] == r["choices"][0]["message"]
        assert h["forerun"]["drafted"] == r["forerun"]["drafted"] and h["forerun"]["accepted"] == r["forerun"]["accepted"]
    assert hot[1]["forerun"]["drafted"] > 0
