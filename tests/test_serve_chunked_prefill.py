"""Chunked prefill: a long prompt is computed a chunk at a time between the running rows'
steps, and its output equals the whole-prompt prefill's, bit for bit (the forwards are
batch-invariant). Asserts the mechanism ran (two or more chunks) and that a running stream
kept stepping while the newcomer's chunks were computed."""
import threading

import pytest

from forerun.kernels import loader as kernel_loader
from forerun.serve.request import ServeRequest
from forerun.config import SamplingParams
from tests.serve_util import tiny_server, wait_idle

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels (batch-invariant)")
LONG = [(3 * i * i + 7 * i + 1) % 61 + 1 for i in range(150)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run(sched, prompt: list[int], max_new: int = 20, k: int = 0):
    """Submit one request (drafts of up to k tokens); (its done event, the box its last event lands in)."""
    done, box = threading.Event(), {}

    def sink(ev):
        if ev.finish_reason or ev.error:
            box["ev"] = ev
            done.set()

    sched.submit(ServeRequest(list(prompt), GREEDY, max_new, k, sink))
    return done, box


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_a_chunked_prompt_gives_the_whole_prompts_tokens(dtype):
    with tiny_server(dtype, k=0, prefill_chunk=16, prefix_cache=False) as chunked, \
            tiny_server(dtype, k=0, prefill_chunk=None, prefix_cache=False) as whole:
        a_done, a = run(chunked.scheduler, LONG)
        b_done, b = run(whole.scheduler, LONG)
        assert a_done.wait(60) and b_done.wait(60)
        assert a["ev"].token_ids == b["ev"].token_ids
        assert a["ev"].stats.prefill_chunks == -(-(len(LONG) - 1) // 16) >= 2
        assert b["ev"].stats.prefill_chunks == 1


def test_running_streams_keep_stepping_while_a_newcomer_prefills():
    with tiny_server("int8", k=0, prefill_chunk=8, prefix_cache=False) as s:
        sched, steps_during = s.scheduler, []
        first_done, first = run(sched, [5, 6, 7], max_new=120)
        while not sched.running:  # the first stream is decoding
            pass
        step = sched._step

        def counted():
            if sched.prefilling:
                steps_during.append(1)
            step()

        sched._step = counted
        late_done, late = run(sched, LONG)
        assert late_done.wait(60) and first_done.wait(60)
        wait_idle(sched)
        assert late["ev"].stats.prefill_chunks >= 2 and len(steps_during) >= 2


def test_chunks_are_sized_by_time_while_streams_run():
    """prefill_chunk_seconds: with another stream running, a chunk computes what the measured rate
    does in that time (at least MIN_CHUNK tokens); with nobody waiting, whole prefill_chunk chunks.
    A measured rate far too slow for 64 tokens in the time given makes every chunk MIN_CHUNK."""
    from forerun.serve.scheduler import MIN_CHUNK

    with tiny_server("int8", k=0, prefill_chunk=64, prefill_chunk_seconds=1e-6, prefix_cache=False) as s, \
            tiny_server("int8", k=0, prefill_chunk=None, prefix_cache=False) as whole:
        sched = s.scheduler
        alone_done, alone = run(sched, LONG)  # nobody waits: chunks of 64
        assert alone_done.wait(60)
        assert alone["ev"].stats.prefill_chunks == -(-(len(LONG) - 1) // 64)
        assert sched.prefill_rate is not None  # measured on those chunks
        first_done, _ = run(sched, [5, 6, 7], max_new=200)
        while not sched.running:
            pass
        late_done, late = run(sched, LONG[::-1])
        ref_done, ref = run(whole.scheduler, LONG[::-1])
        assert late_done.wait(60) and ref_done.wait(60) and first_done.wait(60)
        assert late["ev"].stats.prefill_chunks == -(-(len(LONG) - 1) // MIN_CHUNK)
        assert late["ev"].token_ids == ref["ev"].token_ids


def test_a_draft_models_prompt_feed_is_chunked_too():
    """With a draft model, its own cache takes the prompt in the verifier's chunks (observe_prefix)
    between the running rows' steps: no drafting step feeds the prompt whole, and the output is the
    whole-prefill server's."""
    from forerun.config import SpeculativeConfig
    from forerun.llm import LLM
    from tests.serve_util import VOCAB
    from tests.tiny import tiny_model

    def spec():
        draft = LLM(tiny_model(seed=1, dtype="int8", vocab_size=VOCAB, hidden_size=64, intermediate_size=128), dtype="int8")
        return SpeculativeConfig("draft_model", 3, draft_model=draft)

    with tiny_server("int8", spec=spec(), prefill_chunk=16, prefix_cache=False) as chunked, \
            tiny_server("int8", spec=spec(), prefill_chunk=None, prefix_cache=False) as whole:
        drafter, ends = chunked.scheduler.drafter, []
        feed = drafter.observe_prefix
        drafter.observe_prefix = lambda items: (ends.append([end for _, _, end, _ in items]), feed(items))
        a_done, a = run(chunked.scheduler, LONG, k=3)
        b_done, b = run(whole.scheduler, LONG, k=3)
        assert a_done.wait(60) and b_done.wait(60)
        assert a["ev"].token_ids == b["ev"].token_ids
        assert len(ends) >= 2 and ends[-1] == [len(LONG)]  # chunk by chunk, to the prompt's last token
        assert ends == [[min(16 * (i + 1), len(LONG))] for i in range(len(ends))]
        assert drafter.fed_tokens == len(LONG)  # each prompt token fed once, none in a drafting step
        assert a["ev"].stats.drafted > 0  # and the drafter drafted from there
