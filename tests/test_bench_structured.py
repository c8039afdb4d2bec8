"""The structured-output workload's figures (forerun/bench/structured.py): validity by the
schema's rules, and decode speed by each server's own clock (forerun's `forerun` field,
llama-server's `timings`), so prompt time is apart from decoding time."""
from forerun.bench import structured


def test_the_server_clock_is_read_from_either_server():
    assert structured.server_clock({"forerun": {"prefill_s": 0.5, "decode_s": 2.0}}) == (0.5, 2.0)
    assert structured.server_clock({"timings": {"prompt_ms": 250.0, "predicted_ms": 1500.0}}) == (0.25, 1.5)
    assert structured.server_clock({"forerun": {"drafted": 3}}) == (None, None)


def test_decode_speed_leaves_the_prompt_out_and_needs_every_run_timed():
    def run(tokens, seconds, prefill, decode, text="x"):
        return {"tokens": tokens, "seconds": seconds, "prefill_s": prefill, "decode_s": decode, "text": text,
                "valid": True, "finish": "stop", "forerun": None}

    runs = [run(40, 5.0, 3.0, 2.0), run(60, 7.0, 4.0, 3.0)]
    figures = structured.summary(runs, runs)
    assert figures["tok_s"] == round(100 / 12, 2) and figures["decode_tok_s"] == 20.0 and figures["prefill_s"] == 3.5
    assert figures["identical_to_first"] == 2 and figures["valid_share"] == 1.0
    untimed = structured.summary([runs[0], run(60, 7.0, None, None)], runs)
    assert untimed["decode_tok_s"] is None and untimed["prefill_s"] is None


def test_validity_follows_the_schema():
    good = {"function": "f", "summary": "s", "parameters": [{"name": "a", "meaning": "m"}], "returns": "r"}
    assert structured.valid(good)
    assert not structured.valid({**good, "extra": 1}) and not structured.valid({**good, "summary": "s" * 161})
    assert not structured.valid({**good, "parameters": [{"name": "a"}]})
