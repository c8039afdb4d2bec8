"""Continuous batching keeps greedy outputs exact: a request that joins a running batch
mid-flight, shares forwards with other requests (drafting different k, or none), or takes
a cache row another request just left, emits exactly what it emits alone (float32 and
int8, whose forwards are batch-invariant with forerun's kernels)."""
import threading
import time

import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.kernels import loader as kernel_loader
from forerun.serve.request import ServeRequest
from forerun.serve.scheduler import QueueFull, Scheduler, ServeConfig
from tests.serve_util import tiny_llm

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4],
           [5, 6, 7, 5, 6, 7, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 40, 41] * 6]
KS = [4, 0, 2, 4, 1, 3]  # per-request draft length (0 = plain decoding)


class Collector:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.finish_reason or ev.error:
            self.done.set()

    @property
    def last(self):
        return self.events[-1]


def submit(sched, prompt, k, params):
    sink = Collector()
    sched.submit(ServeRequest(prompt, params, params.max_tokens, k, sink))
    return sink


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_greedy_under_concurrency_equals_alone(dtype):
    if dtype == "int8" and kernel_loader.load() is None:
        pytest.skip("needs the compiled int8 kernels")
    llm = tiny_llm(dtype)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [llm.generate([p], greedy, speculative=None)[0].token_ids for p in PROMPTS]
    sched = Scheduler(llm, SpeculativeConfig("ngram", 4, ngram_min=1), ServeConfig(max_batch=3, max_len=256, block_size=8, batch_aware=False)).start()
    try:
        first = [submit(sched, p, k, greedy) for p, k in zip(PROMPTS[:2], KS[:2])]
        while len(first[0].events) < 3:  # the others join a batch already decoding
            time.sleep(0.001)
        sampled = submit(sched, [7, 8, 9], 3, SamplingParams(temperature=0.9, max_tokens=30, seed=1))  # another group
        rest = [submit(sched, p, k, greedy) for p, k in zip(PROMPTS[2:], KS[2:])]  # 3 rows: some wait for a free row
        for sink in first + rest + [sampled]:
            assert sink.done.wait(60)
    finally:
        sched.stop()
    got = [s.last.token_ids for s in first + rest]
    assert got == alone
    assert all(s.last.finish_reason == "length" for s in first + rest)
    assert sum(s.last.stats.drafted for s in first + rest) > 0
    assert first[1].last.stats.drafted == 0  # k = 0: plain decoding inside a speculative batch
    assert sched.blocks.used == 0 and sorted(sched.free_rows) == [0, 1, 2]


def test_seeded_sampling_is_reproducible_under_concurrency():
    llm = tiny_llm()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=7)
    sched = Scheduler(llm, SpeculativeConfig("ngram", 3, ngram_min=1), ServeConfig(max_batch=4, max_len=128, batch_aware=False)).start()
    try:
        a = submit(sched, PROMPTS[0], 3, params)
        noise = [submit(sched, p, 2, SamplingParams(temperature=0.7, max_tokens=20)) for p in PROMPTS[1:3]]
        for s in [a] + noise:
            assert s.done.wait(60)
        b = submit(sched, PROMPTS[0], 3, params)
        assert b.done.wait(60)
    finally:
        sched.stop()
    assert a.last.token_ids == b.last.token_ids


def test_a_full_queue_refuses_and_nothing_leaks():
    llm = tiny_llm()
    sched = Scheduler(llm, None, ServeConfig(max_batch=1, max_len=128, max_queue=2))  # not started: nothing drains
    params = SamplingParams(temperature=0, max_tokens=5)
    sinks = [submit(sched, [1, 2], 0, params) for _ in range(2)]
    with pytest.raises(QueueFull):
        submit(sched, [1, 2], 0, params)
    sched.start()
    try:
        assert all(s.done.wait(30) for s in sinks)
    finally:
        sched.stop()
    assert sched.blocks.used == 0


def test_batch_aware_k_settles_on_the_faster_choice_per_batch_size():
    from forerun.serve.batch_k import BatchK

    ctl = BatchK(k_max=5, explore_every=10)
    rate = {1: {0: 50, 1: 70, 2: 80, 4: 90, 5: 85}, 8: {0: 200, 1: 180, 2: 150, 4: 120, 5: 100}}  # tokens/s
    picks = {1: [], 8: []}
    for _ in range(200):
        for b in (1, 8):
            k = ctl.choose(b)
            ctl.record(b, k, tokens=rate[b][k] * 0.05, seconds=0.05)
            picks[b].append(k)
    assert max(set(picks[1][-50:]), key=picks[1][-50:].count) == 4  # one sequence: speculation pays
    assert picks[8][-50:].count(0) >= 45  # a full batch: plain decoding, exploring 1 step in 10
    assert ctl.bucket(5) == ctl.bucket(8) == 8 and ctl.bucket(1) == 1


def test_a_batch_aware_server_stays_exact():
    llm = tiny_llm()
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [llm.generate([p], greedy, speculative=None)[0].token_ids for p in PROMPTS]
    sched = Scheduler(llm, SpeculativeConfig("ngram", 4, ngram_min=1), ServeConfig(max_batch=4, max_len=256, batch_aware=True)).start()
    try:
        sinks = [submit(sched, p, 4, greedy) for p in PROMPTS]
        assert all(s.done.wait(60) for s in sinks)
    finally:
        sched.stop()
    assert [s.last.token_ids for s in sinks] == alone
    assert sched.batch_k.table()  # it measured something


def test_batch_aware_k_tries_others_less_often_while_the_best_holds_and_notices_a_change():
    from forerun.serve.batch_k import BatchK

    ctl = BatchK(k_max=4, explore_every=10, max_backoff=8)
    rate = {0: 200, 1: 150, 2: 120, 4: 80}  # a full batch: plain decoding wins
    picks = []
    for step in range(800):
        if step == 500:
            rate = {0: 100, 1: 150, 2: 200, 4: 120}  # the machine changed: k = 2 wins now
        k = ctl.choose(8)
        ctl.record(8, k, tokens=rate[k] * 0.05, seconds=0.05)
        picks.append(k)
    tries = [i for i, k in enumerate(picks[:500]) if k != 0 and i >= 8]  # after the first rounds
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:4] == [10, 20, 40, 80] and set(gaps[4:]) == {80}  # 10 doubles to 80 while k = 0 holds
    assert picks[-100:].count(2) >= 90  # the change was noticed at the next try and kept


def test_a_bucket_drafts_no_more_than_the_best_of_the_smaller_one():
    """Plain decoding won at 4 rows: 8 rows never draft (no tries either); where 4 rows
    settled on k = 2, 8 rows consider 0..2 only."""
    from forerun.serve.batch_k import BatchK

    for rate4, allowed8 in (({0: 100, 1: 90, 2: 80, 4: 70}, {0}), ({0: 100, 1: 110, 2: 120, 4: 115}, {0, 1, 2})):
        ctl = BatchK(k_max=4, explore_every=5)
        for _ in range(40):
            k = ctl.choose(4)
            ctl.record(4, k, tokens=rate4[k] * 0.05, seconds=0.05)
        picks = []
        for _ in range(200):
            k = ctl.choose(8)
            ctl.record(8, k, tokens=(300 - 40 * k) * 0.05, seconds=0.05)
            picks.append(k)
        assert set(picks) == allowed8
        assert picks[-50:].count(0) >= 45


def test_a_tries_catch_up_is_paid_back_before_the_next_try():
    """Tries whose draft model caught up for 1 s each take at most try_budget (5%) of the
    bucket's time: about 20 s (400 steps) between them; without overheads the gap (10 steps)
    alone decides."""
    from forerun.serve.batch_k import BatchK

    def tries(overhead: float) -> list[int]:
        ctl = BatchK(k_max=2, explore_every=10, max_backoff=1)
        out, last = [], 0
        for step in range(2000):
            k = ctl.choose(8)
            paid = overhead if k and not last else 0.0  # the drafter catches up after steps without it
            ctl.record(8, k, tokens=(10 if k == 0 else 8) * 0.05, seconds=0.05, overhead=paid)
            last = k
            if k and step >= 6:  # after the first rounds (0, 0, 1, 1, 2, 2)
                out.append(step)
        return out

    free, costly = tries(0.0), tries(1.0)
    assert [b - a for a, b in zip(free, free[1:])] == [10] * (len(free) - 1)
    gaps = [b - a for a, b in zip(costly, costly[1:])]
    paid = 1.0 * (len(costly) + 1)  # each try's catch-up, and the first rounds' one
    assert min(gaps) >= 300 and paid <= 0.05 * (2000 * 0.05 + paid) + 1.0


def test_new_prompts_fed_to_the_draft_model_count_against_drafting():
    """k = 4 emits 125 tokens/s between prompts, plain decoding 100; when every 4th drafting
    step also feeds a new request's prompt for 0.1 s, drafting costs 0.005 s more per token
    (77 tokens/s) and plain decoding wins."""
    from forerun.serve.batch_k import BatchK

    for prompt, winner in ((0.0, 4), (0.1, 0)):
        ctl = BatchK(k_max=4, explore_every=10)
        ks = []
        for step in range(300):
            k = ctl.choose(1)
            ctl.record(1, k, tokens=5 if k == 4 else (1 + 0.2 * k), seconds=0.04 if k == 4 else 0.01 * (1 + k),
                       prompt=prompt if k and step % 4 == 0 else 0.0)
            ks.append(k)
        assert ks[-50:].count(winner) >= 40, (prompt, ks[-50:])


def test_drafting_is_switched_on_only_where_the_tokens_left_pay_for_the_catch_up():
    """k = 2 emits 150 tokens/s, plain decoding 100: 100 tokens left save 0.33 s, not
    enough for a 1 s catch-up; 1000 tokens save 3.3 s, enough. Nothing to feed: no question."""
    from forerun.serve.batch_k import BatchK

    ctl = BatchK(k_max=2, explore_every=1000)
    for _ in range(6):
        k = ctl.choose(8)
        ctl.record(8, k, tokens={0: 100, 1: 90, 2: 150}[k] * 0.05, seconds=0.05)
    assert ctl.choose(8) == 2
    assert ctl.choose(8, switch_cost=1.0, remaining=100) == 0
    assert ctl.choose(8, switch_cost=1.0, remaining=1000) == 2
    assert ctl.choose(8, switch_cost=0.0, remaining=10) == 2


def test_a_buckets_first_try_waits_until_its_catch_up_fits_the_budget():
    """Switching drafting on would first cost 1 s of catch-up: a bucket tries k > 0 only
    once it has run 1 / try_budget = 20 s (400 steps of 0.05 s) without drafting."""
    from forerun.serve.batch_k import BatchK

    ctl = BatchK(k_max=2, explore_every=10)
    first = None
    for step in range(1000):
        k = ctl.choose(8, switch_cost=1.0, remaining=10_000)
        ctl.record(8, k, tokens=5, seconds=0.05, overhead=1.0 if k else 0.0)
        if k and first is None:
            first = step
    assert first in (400, 401)  # 400 x 0.05 s, give or take a float rounding


def test_drafting_is_tried_though_the_catch_up_grows_with_every_plain_step():
    """One row, a draft model fed 4 ms a token: every k = 0 step (80 ms) leaves one more token
    to catch up on, 4 ms, as much as the budget gains (5% of 80 ms), so the budget alone never
    lets a first try start. A first try whose catch-up fits in one mean step starts anyway
    (after k = 0's own first steps); a 1 s catch-up still waits for the budget (the test above)."""
    from forerun.serve.batch_k import BatchK

    ctl = BatchK(k_max=2, explore_every=10)
    unfed, ks = 1, []
    for _ in range(300):
        k = ctl.choose(1, switch_cost=0.004 * unfed, remaining=10_000)
        paid = 0.004 * unfed if k else 0.0
        unfed = 1 if k else unfed + 1
        ctl.record(1, k, tokens=2.5 if k else 1.0, seconds=0.1 if k else 0.08, overhead=paid)
        ks.append(k)
    assert ks[:3] == [0, 0, 1]  # the first try right after k = 0's first rounds
    assert ks[-50:].count(0) <= 10  # drafting (25 tokens/s against 12.5) is what it runs


def test_the_draft_models_catch_up_is_counted_apart_from_steady_drafting():
    """Batch-aware k compares per-step rates; the draft model's one-time catch-up after steps
    run with k = 0 is timed apart so that a try of k > 0 is not judged on it. A new prompt's
    feed is timed too, but as `prompt_seconds`: a cost every request pays once drafting is on."""
    import torch

    from forerun.drafters.base import DraftRequest
    from forerun.drafters.draft_model import DraftModelDrafter
    from tests.tiny import tiny_model

    drafter = DraftModelDrafter(tiny_model(seed=3, dtype="float32"))
    drafter.start(num_rows=1, capacity=128, verifier_cache=None)
    params, gen = SamplingParams(temperature=0), torch.Generator().manual_seed(0)
    tokens = [i % 32 for i in range(5, 45)]  # the tiny vocabulary has 32 tokens
    draft = drafter.propose([DraftRequest(0, tokens, 3)], params, gen)[0]
    prompt = drafter.prompt_seconds
    assert prompt > 0 and drafter.catch_up_seconds == 0  # 40 prompt tokens fed at once, a new row
    tokens = tokens + draft.tokens[:2] + [7]  # two drafted tokens accepted, one recovered
    draft = drafter.propose([DraftRequest(0, tokens, 3)], params, gen)[0]
    assert drafter.catch_up_seconds == 0 and drafter.prompt_seconds == prompt  # a drafting step feeds 1-2 tokens
    tokens = tokens + draft.tokens[:1] + list(range(10, 20))  # then ten steps without drafting
    drafter.propose([DraftRequest(0, tokens, 3)], params, gen)
    assert drafter.catch_up_seconds > 0 and drafter.prompt_seconds == prompt
    drafter.release(0)  # a new request takes the row
    drafter.propose([DraftRequest(0, tokens[:30], 3)], params, gen)
    assert drafter.prompt_seconds > prompt
