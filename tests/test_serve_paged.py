"""The paged KV cache: blocks scattered anywhere in the pool give the same logits as the
row cache for ragged chains and token trees (with tree compaction), and a pool too small for
every row at once still serves every request exactly, admitting as blocks come back."""
import random
import time

import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.kv.cache import chain_batch, tree_batch
from forerun.kv.blocks import BlockAllocator, BlockTable
from forerun.kv.paged import PagedKVCache
from forerun.serve.request import ServeRequest
from forerun.serve.scheduler import Scheduler, ServeConfig, TooLarge
from tests.serve_util import tiny_llm
from tests.test_serve_batching import PROMPTS, Collector
from tests.tiny import tiny_model


def scattered_cache(model, rows: int, capacity: int, bs: int = 4) -> PagedKVCache:
    """Every row's blocks drawn in a shuffled order from a pool with room to spare."""
    per_row = -(-capacity // bs)
    cache = PagedKVCache(model, rows, capacity, num_blocks=rows * per_row + 5, block_size=bs)
    ids = list(range(rows * per_row + 5))
    random.Random(0).shuffle(ids)
    for r in range(rows):
        cache.set_table(r, ids[r * per_row : (r + 1) * per_row])
    return cache


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_paged_forwards_equal_row_cache_forwards(dtype):
    model = tiny_model(dtype=dtype, hidden_size=64, intermediate_size=128)
    rows, cap = 3, 40
    paged, plain = scattered_cache(model, rows, cap), model.new_cache(rows, cap)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    outs = []
    for cache in (paged, plain):
        model(chain_batch(prompts, [0, 0, 0], [0, 1, 2], model.device), cache)
        step = model(chain_batch([[3, 4, 5], [6], [7, 8]], [7, 2, 5], [2, 0, 1], model.device), cache).logits  # ragged, rows out of order
        tree = tree_batch([[9, 1, 2, 3]], [[-1, 0, 0, 1]], [10], [2], model.device)
        logits = model(tree, cache).logits
        cache.move(2, [11, 13], [11, 12])
        after = model(chain_batch([[5]], [13], [2], model.device), cache).logits
        outs.append((step, logits, after))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_padding_never_writes_into_another_rows_blocks():
    model = tiny_model(dtype="float32")
    cache = PagedKVCache(model, rows=2, capacity=20, num_blocks=5, block_size=4)
    cache.set_table(0, [0])  # row 0 owns one block: its padding (slots 4..) goes to the scratch block
    cache.set_table(1, [1, 2, 3, 4])
    model(chain_batch([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], [0], [1], model.device), cache)
    before = [p[1:4].clone() for p in cache.k_pool]
    model(chain_batch([[1], [5, 6, 7, 8, 9, 10]], [2, 10], [0, 1], model.device), cache)  # row 0 padded to slots 2..7
    for b, p in zip(before, cache.k_pool):  # row 1's slots 0..9 (blocks 1, 2 and half of 3) untouched
        assert torch.equal(b[:2], p[1:3]) and torch.equal(b[2][:, :2], p[3][:, :2])


def test_a_small_pool_serves_everything_exactly_preempting_as_it_runs_out():
    llm = tiny_llm()
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    alone = [llm.generate([p], greedy, speculative=None)[0].token_ids for p in PROMPTS]
    cfg = ServeConfig(max_batch=4, max_len=150, block_size=8, num_blocks=24, batch_aware=False)  # ~2 requests at a time
    sched = Scheduler(llm, SpeculativeConfig("ngram", 4, ngram_min=1), cfg)
    with pytest.raises(TooLarge):
        sched.submit(ServeRequest([1] * 200, greedy, 50, 0, Collector()))
    sinks = [Collector() for _ in PROMPTS]
    for p, s in zip(PROMPTS, sinks):
        sched.submit(ServeRequest(p, greedy, 60, 4, s))
    peak = []
    sched.start()
    try:
        deadline = time.time() + 60
        while not all(s.done.is_set() for s in sinks) and time.time() < deadline:
            peak.append(len(sched.running))
            time.sleep(0.002)
    finally:
        sched.stop()
    assert [s.last.token_ids for s in sinks] == alone
    assert all(s.last.error is None for s in sinks)
    assert sched.preemptions > 0  # the pool, not the rows, bounded the batch: the newest waited
    assert sched.blocks.used == 0
    assert (sched.cache.tables == sched.cache.scratch).all()  # every row points at the scratch block again


def test_block_tables_grow_and_release():
    pool = BlockAllocator(6, 4)
    a, b = BlockTable(pool), BlockTable(pool)
    assert a.ensure(9) and b.ensure(8) and pool.free == 1
    assert not b.ensure(13) and b.blocks == [3, 4]  # short: nothing taken
    a.release()
    assert b.ensure(13) and pool.used == 4
    b.release()
    assert pool.used == 0
