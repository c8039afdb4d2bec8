"""Faults: clients that vanish mid-stream or mid-request, requests that fail inside the
engine, a full queue. After each, no KV block or cache row is held and the server serves."""
import concurrent.futures
import time

import httpx
import pytest

from forerun.serve import scheduler as scheduler_mod
from tests.serve_util import tiny_server, wait_idle

LONG = {"prompt": "0123", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def slowed(monkeypatch, seconds: float):
    real = scheduler_mod.Scheduler._step

    def slow(self):
        real(self)
        time.sleep(seconds)

    monkeypatch.setattr(scheduler_mod.Scheduler, "_step", slow)
    return tiny_server(k=2)


@pytest.fixture()
def slow_server(monkeypatch):
    """Steps slowed to >= 5 ms, so a 240-token request runs for over a second."""
    with slowed(monkeypatch, 0.005) as s:
        yield s


@pytest.fixture()
def slower_server(monkeypatch):
    """Steps slowed to >= 25 ms, so a 240-token request (at most 3 tokens a step at k 2) runs
    for 2 s or more: an idle server 1.5 s after its client gave up means it was cancelled."""
    with slowed(monkeypatch, 0.025) as s:
        yield s


def assert_clean(s):
    wait_idle(s.scheduler, timeout=2.0)
    assert not s.scheduler.running and not s.scheduler.waiting
    assert s.scheduler.blocks.used == 0
    assert sorted(s.scheduler.free_rows) == list(range(s.scheduler.cfg.max_batch))


def still_serves(s):
    with s.client() as c:
        r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_a_disconnect_mid_stream_frees_the_sequence_at_once(slow_server):
    s = slow_server
    with s.client() as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
            assert s.scheduler.running and s.scheduler.blocks.used > 0
        t0 = time.time()  # the response is closed: the connection is gone
        wait_idle(s.scheduler, timeout=2.0)
        assert time.time() - t0 < 1.0  # long before the 240 tokens could have finished
    assert_clean(s)
    assert 'forerun_requests_total{outcome="cancelled"} 1.0' in s.client().get("/metrics").text
    still_serves(s)


def test_a_non_streaming_client_that_gives_up_is_cancelled(slower_server):
    """Tokens keep arriving while the client is gone: the server still notices (it checks
    every 0.25 s, not only when no token came) and frees the sequence long before its end."""
    s = slower_server
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=s.url, timeout=0.4) as c:
            c.post("/v1/completions", json=LONG)
    gave_up = time.time()
    wait_idle(s.scheduler, timeout=5.0)
    assert time.time() - gave_up < 1.5
    assert 'forerun_requests_total{outcome="cancelled"} 1.0' in s.client().get("/metrics").text
    assert_clean(s)
    still_serves(s)


def test_many_cancellations_mixed_with_finishing_requests(slow_server):
    s = slow_server
    clients = [httpx.Client(base_url=s.url, timeout=30) for _ in range(6)]
    streams = [c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) for c in clients]
    responses = [st.__enter__() for st in streams]  # 6 requests, 4 rows: two wait in the queue
    for r in responses[:4]:
        next(r.iter_lines())
    for st in streams[::2]:  # cancel three: running and waiting ones
        st.__exit__(None, None, None)
    for c in clients:
        c.close()
    assert_clean(s)
    still_serves(s)


def test_an_engine_failure_fails_the_batch_not_the_server(monkeypatch):
    with tiny_server(k=2) as s:
        calls = {"n": 0}
        real = scheduler_mod.step_all

        def flaky(sched, lives):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real(sched, lives)

        monkeypatch.setattr(scheduler_mod, "step_all", flaky)
        with s.client() as c:
            r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 50, "ignore_eos": True})
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
            with c.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 8, "stream": True}) as st:
                assert st.status_code == 200 and list(st.iter_lines())[-2] == "data: [DONE]"
        assert_clean(s)
        still_serves(s)


def test_a_full_queue_answers_429(monkeypatch):
    with tiny_server(k=0, max_batch=1, max_queue=1) as s:
        monkeypatch.setattr(s.scheduler, "_admit", lambda: None)  # nothing leaves the queue
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(lambda: s.client().post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
            while not s.scheduler.waiting:
                time.sleep(0.01)
            with s.client() as c:
                r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            monkeypatch.undo()  # admission resumes: the queued request completes
            s.scheduler.wake()
            assert queued.result(timeout=30).status_code == 200
        assert_clean(s)
        still_serves(s)


def test_a_failing_group_does_not_fail_its_batch_mates(monkeypatch):
    from forerun.serve import step as step_mod

    real = step_mod._step_group

    def sampled_groups_fail(sched, group, row_k):
        if not group[0].req.params.greedy:
            raise RuntimeError("injected")
        return real(sched, group, row_k)

    monkeypatch.setattr(step_mod, "_step_group", sampled_groups_fail)
    with tiny_server(k=2) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
        post = lambda body: s.client().post("/v1/completions", json={"prompt": "abab", "max_tokens": 30, "ignore_eos": True, **body})  # noqa: E731
        futures = [pool.submit(post, {"temperature": t}) for t in (0, 0.8, 0, 0.8)]
        codes = [f.result(timeout=60).status_code for f in futures]
        assert codes == [200, 500, 200, 500]
        assert_clean(s)
