"""A KV pool sized by a memory budget, taken as used, and preemption when it runs out.

Requests hold the blocks their tokens fill, not their whole max_tokens, so a pool that holds
one full-length sequence serves several at once; when it runs out the newest sequence gives
its row and blocks back and waits at the head of the queue, and on its return its K/V are read
back from the prefix cache or computed again. Prefill is batch-invariant, so a preempted
request's output is the one it gives alone: greedy token for token, seeded sampling with a
fixed k bit for bit. Each test asserts that preemption happened (the mechanism ran).
"""
import time

import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache
from forerun.serve.request import ServeRequest
from forerun.serve.scheduler import Scheduler, ServeConfig, kv_bytes_per_token, pool_plan
from tests.serve_util import tiny_llm
from tests.test_serve_batching import PROMPTS, Collector

GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def run_all(sched: Scheduler, prompts, params, ks, seeds=None) -> list[Collector]:
    sinks = [Collector() for _ in prompts]
    for i, (p, s, k) in enumerate(zip(prompts, sinks, ks)):
        par = params if seeds is None else SamplingParams(**{**params.__dict__, "seed": seeds[i]})
        sched.submit(ServeRequest(p, par, par.max_tokens, k, s))
    sched.start()
    try:
        deadline = time.time() + 120
        while not all(s.done.is_set() for s in sinks) and time.time() < deadline:
            time.sleep(0.005)
    finally:
        sched.stop()
    assert all(s.done.is_set() for s in sinks), "a request never finished"
    assert all(s.last.error is None for s in sinks), [s.last.error for s in sinks]
    return sinks


# 4-token blocks, 40 of them: 160 slots, one sequence of max_len 150 (+ its draft) fits, six do not
SMALL = dict(max_batch=6, max_len=150, block_size=4, num_blocks=40, batch_aware=False)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("prefix_cache", [False, True], ids=["recompute", "prefix-cache"])
def test_preempted_requests_give_their_greedy_output_alone(dtype, prefix_cache):
    llm = tiny_llm(dtype)
    spec = SpeculativeConfig("ngram", 4, ngram_min=1)
    alone = [llm.generate([p], GREEDY, speculative=spec)[0].token_ids for p in PROMPTS]
    sched = Scheduler(llm, spec, ServeConfig(**SMALL, prefix_cache=prefix_cache))
    sinks = run_all(sched, PROMPTS, GREEDY, [4, 0, 2, 4, 1, 3])
    assert [s.last.token_ids for s in sinks] == alone
    assert sched.preemptions > 0  # the pool ran out and sequences waited
    assert sched.blocks.used == 0 and not sched.waiting
    if prefix_cache:  # a returning sequence read its blocks back
        assert sched.prefix.stats.hit > 0


def test_seeded_sampling_is_bit_for_bit_whether_preempted_or_not():
    llm = tiny_llm("float32")
    spec = SpeculativeConfig("ngram", 3, ngram_min=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=60, ignore_eos=True)
    seeds = [11, 12, 13, 14, 15, 16]
    roomy = Scheduler(llm, spec, ServeConfig(max_batch=6, max_len=150, block_size=4, batch_aware=False))
    tight = Scheduler(llm, spec, ServeConfig(**SMALL))
    want = [s.last.token_ids for s in run_all(roomy, PROMPTS, params, [3] * 6, seeds)]
    got = [s.last.token_ids for s in run_all(tight, PROMPTS, params, [3] * 6, seeds)]
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert got == want


def test_a_cancelled_preempted_request_ends_with_what_it_generated():
    llm = tiny_llm("float32")
    sched = Scheduler(llm, None, ServeConfig(**SMALL))
    sinks = [Collector() for _ in range(3)]
    reqs = [ServeRequest(list(range(1, 30)), GREEDY, 90, 0, s) for s in sinks]
    for r in reqs:
        sched.submit(r)
    sched.start()
    try:
        deadline = time.time() + 60
        while sched.preemptions == 0 and time.time() < deadline:
            time.sleep(0.002)
        waiting = [r for r in reqs if any(getattr(w, "req", None) is r for w in list(sched.waiting))]
        for r in reqs:
            r.cancelled.set()
        sched.wake()
        while not all(s.done.is_set() for s in sinks) and time.time() < deadline:
            time.sleep(0.005)
    finally:
        sched.stop()
    assert sched.preemptions > 0 and all(s.done.is_set() for s in sinks)
    assert all(s.last.finish_reason == "cancelled" for s in sinks)
    for r, s in zip(reqs, sinks):
        if r in waiting:  # preempted: its tokens so far are in its last event
            assert s.last.completion_tokens == len(s.last.token_ids) > 0
    assert sched.blocks.used == 0


def test_the_pool_is_planned_from_the_budget():
    llm = tiny_llm("float32")
    block_bytes = kv_bytes_per_token(llm.model) * 16
    c = llm.model.config
    assert block_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * 16
    # the default max_len is the model's context; the budget gives the blocks, at most every row's worth
    gb = 100 * block_bytes / 2**30
    assert pool_plan(ServeConfig(max_batch=8, kv_cache_gb=gb), 256, 0, block_bytes) == (256, 100)
    assert pool_plan(ServeConfig(max_batch=2, kv_cache_gb=1.0), 256, 0, block_bytes) == (256, 2 * 17)
    # a budget under one full-context sequence: a defaulted max_len shrinks to fit, one asked for is refused
    small = 10 * block_bytes / 2**30
    assert pool_plan(ServeConfig(kv_cache_gb=small), 256, 4, block_bytes) == (10 * 16 - 5, 10)
    with pytest.raises(ConfigError, match="max_len 200 does not fit the KV pool: kv_cache_gb"):
        pool_plan(ServeConfig(max_len=200, kv_cache_gb=small), 256, 0, block_bytes)
    with pytest.raises(ConfigError, match="num_blocks 3"):
        pool_plan(ServeConfig(max_len=100, num_blocks=3), 256, 0, block_bytes)
    for field in ("kv_cache_gb", "prefix_cache_gb"):
        for bad in (0, float("inf"), float("nan")):
            with pytest.raises(ConfigError, match=f"{field} must be a finite number > 0"):
                ServeConfig(**{field: bad})


def test_the_server_takes_its_context_from_the_model_and_max_tokens_defaults_to_the_rest():
    from forerun.serve.main import build_server
    from tests.serve_util import Server

    import httpx

    llm = tiny_llm("float32")
    app = build_server(llm, None, ServeConfig(max_batch=2), default_max_tokens=None, names=("tiny",))
    assert app.state.limits.max_len == llm.max_context == 256
    with Server(app) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "0123456789", "ignore_eos": True},
                       timeout=120).json()
    assert r["usage"]["completion_tokens"] == 256 - 10 and r["choices"][0]["finish_reason"] == "length"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_caches_take_memory_as_their_slots_are_written():
    """A 1 GiB row cache costs next to nothing until written: its pages come from calloc's fresh
    mappings, not torch.zeros' memset."""
    before = _rss_mb()
    cache = KVCache(2, 2, 2, 2**15, 512, torch.float32, "cpu")  # 2 layers x K/V x 2 rows x 2 heads x 32k x 512 x 4 B
    assert sum(t.nbytes for t in cache.k + cache.v) == 2**30
    assert _rss_mb() - before < 64
    cache.k[0][0, 0, :100] = 1.0
    assert float(cache.k[0].sum()) == 100 * 512 and float(cache.v[1][1].abs().sum()) == 0.0
    assert _rss_mb() - before < 128
