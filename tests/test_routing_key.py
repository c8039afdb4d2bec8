"""The Ray app's routing key: every turn of a session gets its first turn's key (whatever the
session sends first), and different sessions get different keys. Pure functions: no Ray needed."""
import doctest
import json

from forerun.serve import routing_key as rk


def key(**body) -> str:
    return rk.routing_key(json.dumps(body).encode())


def test_a_chat_keeps_its_key_turn_after_turn_with_or_without_a_system_prompt():
    for head in ([], [{"role": "system", "content": "You are terse."}]):
        turns = [head + [{"role": "user", "content": "read f.py"}]]
        for i in range(3):
            turns.append(turns[-1] + [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"next {i}"}])
        assert len({key(messages=t) for t in turns}) == 1


def test_a_responses_session_keeps_its_key_from_text_to_items():
    first = key(input="read f.py", instructions="be terse")
    later = key(input=[{"role": "user", "content": [{"type": "input_text", "text": "read f.py"}]},
                       {"role": "assistant", "content": "done"}, {"role": "user", "content": "now g.py"}],
                instructions="be terse")
    assert first == later and first != key(input="read f.py", instructions="be verbose")


def test_sessions_differ_and_prompt_cache_key_wins():
    a, b = key(messages=[{"role": "user", "content": "a"}]), key(messages=[{"role": "user", "content": "b"}])
    assert a != b and a and b
    assert key(messages=[{"role": "user", "content": "a"}], prompt_cache_key="s") == key(prompt_cache_key="s") == "key:s"
    assert key(prompt="x" * 5000) == key(prompt="x" * 5000 + "more")  # a completion: its opening characters
    assert rk.routing_key(b"not json") == rk.routing_key(b"[1, 2]") == ""


def test_doctests():
    assert doctest.testmod(rk).failed == 0
