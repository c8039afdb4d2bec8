"""The bench report's math: per-token alpha, predicted tau, acceptance by position, and the
provenance letters the engine records for each generated token."""
import random

import pytest

from forerun.adaptive import expected_tokens
from forerun.bench.cell import PairRun, alpha, position_acceptance, predicted_tau, summarize_cell, time_split
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.metrics import SpecStats, merge
from forerun.bench.provenance import Sample, render_terminal, shares, spans, token_pieces
from tests.tiny import tiny_model


def simulate(a: float, k: int, steps: int, seed: int = 0) -> SpecStats:
    """Steps of a fixed-k chain whose draft tokens are each accepted with probability a."""
    rng, s = random.Random(seed), SpecStats()
    for _ in range(steps):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        s.record_step(k, n)
        s.generated += n + 1
    return s


@pytest.mark.parametrize("a,k", [(0.3, 3), (0.6, 5), (0.9, 4)])
def test_predicted_tau_matches_iid_acceptance(a, k):
    s = simulate(a, k, 20000)
    assert alpha(s) == pytest.approx(a, abs=0.02)
    assert predicted_tau(s) == pytest.approx(expected_tokens(alpha(s), k), rel=1e-9)  # the Leviathan formula
    assert predicted_tau(s) == pytest.approx(s.mean_accepted_length, rel=0.02)  # iid: prediction == observation
    # position i is kept with probability a^(i+1) when every step drafts k tokens
    assert position_acceptance(s) == pytest.approx([a ** (i + 1) for i in range(k)], abs=0.02)


def test_empty_drafts_count_as_one_token_steps():
    s = SpecStats()
    s.record_step(0, 0)  # nothing drafted (no n-gram match, or k = 0 under auto)
    s.record_step(2, 2)
    s.record_step(2, 0)
    assert s.drafted_at == [2, 2] and s.accepted_at == [1, 1]
    assert alpha(s) == pytest.approx(2 / 3)
    a = 2 / 3
    assert predicted_tau(s) == pytest.approx((3 + 2 * a + 2 * a * a) / 3)
    assert position_acceptance(s) == [0.5, 0.5]
    assert merge([s, s]).drafted_at == [4, 4]


def test_time_split_and_cell_summary():
    plain = SpecStats(generated=10, verifier_forwards=10, prefill_time=1.0, decode_time=4.0, verify_time=3.5)
    spec = SpecStats(generated=10, verifier_forwards=5, prefill_time=1.0, decode_time=2.0, draft_time=0.5, verify_time=1.25,
                     accepted=5, drafted=10, rejections=5, accepted_at=[4, 1], drafted_at=[5, 5])
    assert time_split(spec) == {"prefill_s": 1.0, "draft_s": 0.5, "verify_s": 1.25, "overhead_s": 0.25}
    pairs = [PairRun(f"p{i}", plain, spec, [1, 2], [1, 2]) for i in range(3)]
    c = summarize_cell("qa", "ngram k=2", 2, pairs, greedy=True)
    assert c["speedup"] == pytest.approx(5 / 3) and c["verdict"] == "faster" and c["identical"]
    assert c["tau"] == 2.0 and c["acceptance_by_position"] == [0.8, 0.2] and c["drafted_per_step"] == 2.0


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1]]


@pytest.mark.parametrize("spec", [SpeculativeConfig("ngram", 3), SpeculativeConfig("ngram", 3, ngram_branches=2), None])
def test_engine_records_where_each_token_came_from(spec):
    llm = LLM(tiny_model(seed=0, num_hidden_layers=2))
    for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30), speculative=spec):
        s = o.stats
        assert len(s.origins) == len(o.token_ids) == s.generated
        assert set(s.origins) <= set("arbp")
        assert s.origins.count("a") <= s.accepted  # equal unless the budget cut the last step
        assert len(s.origins) - s.origins.count("a") <= s.verifier_forwards + s.prefill_tokens  # one verifier token a step, the first from the prefill
        assert s.prefill_tokens == 1 and s.origins[0] == "p"
        if spec is None:
            assert s.origins == "p" * len(o.token_ids)
        else:
            assert s.origins.count("r") <= s.rejections and s.origins.count("b") <= s.bonus


def test_provenance_rendering():
    pieces = token_pieces(lambda ids: "".join("xyz"[i] for i in ids), [0, 1, 2, 2])
    assert pieces == ["x", "y", "z", "z"]
    assert spans(pieces, "aarb") == [("xy", "a"), ("z", "r"), ("z", "b")]
    assert shares("aarb")["a"] == 0.5
    from rich.console import Console

    console = Console(record=True, width=80, force_terminal=True)
    render_terminal(Sample("t", pieces, "aarb"), console)
    assert "42mxy" in console.export_text(styles=True, clear=False)  # green behind accepted tokens
    text = console.export_text()
    assert "xyzz" in text and "accepted draft 50%" in text
