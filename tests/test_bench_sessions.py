"""The agent-session workload (forerun/bench/sessions.py): sessions built from the standard
library at run time, played against a server turn by turn (the history resent each turn),
and the figures taken from the streamed responses. Played here against a fake server."""
import json

import httpx

from forerun.bench import sessions


def test_sessions_are_built_from_the_standard_library_at_run_time():
    built = sessions.build_sessions(2, 4)
    assert len(built) == 2 and len({s.module for s in built}) == 2
    for s in built:
        assert [m["role"] for m in s.opening] == ["system", "user"] and "read_file" in s.opening[0]["content"]
        assert len(s.asks) == 4 and all("Tool result:" in a for a in s.asks[1:])
        assert "def " in s.opening[1]["content"]
    many = sessions.build_sessions(8, 4)  # the two of the published runs first, then six more
    assert [s.module for s in many][:2] == ["bisect", "calendar"] and len({s.module for s in many}) == 8


def test_a_session_resends_its_history_and_the_figures_come_from_the_stream():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body["messages"])
        n = len(seen)
        chunks = [{"choices": [{"delta": {"content": f"answer {n} "}}]}, {"choices": [{"delta": {"content": "done"}}]},
                  {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 100 * n,
                                            "prompt_tokens_details": {"cached_tokens": 90 * (n - 1)}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    session = sessions.build_sessions(1, 3)[0]
    real = httpx.Client
    httpx.Client = lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    try:
        turns = sessions.play("http://fake", session, 8)
    finally:
        httpx.Client = real
    assert len(seen) == 3 and seen[2][-2] == {"role": "assistant", "content": "answer 2 done"}
    assert seen[1][:len(seen[0])] == seen[0]  # the history resent, unchanged
    assert [t.cached_tokens for t in turns] == [0, 90, 180] and all(t.tokens == 3 for t in turns)
    figures = sessions.summary([turns])
    assert figures["sessions"] == 1 and figures["cached_share_later"] == round(270 / 500, 3)
    assert figures["ttft_later_under_100_new_s"] is None  # turns 2 and 3 leave 110 and 120 tokens to compute


def test_the_later_turns_that_leave_under_100_tokens_are_reported_apart():
    def turn(ttft, prompt, cached):
        return sessions.Turn(ttft=ttft, seconds=ttft + 1.0, tokens=11, prompt_tokens=prompt, cached_tokens=cached)

    figures = sessions.summary([[turn(9.0, 1000, 0), turn(0.8, 1100, 1024), turn(1.6, 1300, 1150)],
                                [turn(8.0, 900, 0), turn(0.6, 1000, 912)]])
    assert figures["ttft_later_s"] == round((0.8 + 1.6 + 0.6) / 3, 3)
    assert figures["ttft_later_under_100_new_s"] == 0.7  # 76 and 88 new tokens; not the turn with 150


def test_servers_take_turns_turn_by_turn_each_with_its_own_history():
    order = []

    def handler(request: httpx.Request) -> httpx.Response:
        host, messages = request.url.host, json.loads(request.content)["messages"]
        order.append((host, len(messages)))
        answer = f"{host} says {len(messages)}"
        chunks = [{"choices": [{"delta": {"content": answer}}]},
                  {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        assert all(m["content"].startswith(host) for m in messages if m["role"] == "assistant")  # its own answers only
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    session = sessions.build_sessions(1, 3)[0]
    real = httpx.Client
    httpx.Client = lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    try:
        a, b = sessions.play_interleaved(["http://a", "http://b"], session, 8)
    finally:
        httpx.Client = real
    assert order == [("a", 2), ("b", 2), ("a", 4), ("b", 4), ("a", 6), ("b", 6)]  # alternated, each turn on both
    assert len(a) == len(b) == 3 and [t.text for t in b] == ["b says 2", "b says 4", "b says 6"]
