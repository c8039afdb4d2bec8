"""`forerun quality`: the fidelity math on hand-made log-probs, llama.cpp's chunking and log,
and float32 vs int8 on a tiny random model."""
import doctest
import math

import pytest
import torch

from forerun.bench import quality
from forerun.bench.quality import (Tally, evaluate, kl_divergence, make_chunks, parse_llama_log, perplexity,
                                   scored_span, token_nll, top1_agreement)
from forerun.cli import main
from tests.tiny import tiny_model


def test_doctests():
    assert doctest.testmod(quality).failed == 0


def logp(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_kl_of_identical_distributions_is_zero():
    p = torch.log_softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert kl_divergence(p, p).tolist() == [0.0] * 5


def test_kl_by_hand():
    # P = (1/2, 1/2), Q = (1/4, 3/4): 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3). P = (1, 0): ln 2, the P = 0 term 0.
    kl = kl_divergence(logp([0.5, 0.5], [1.0, 0.0]), logp([0.25, 0.75], [0.5, 0.5]))
    assert kl.tolist() == pytest.approx([0.5 * math.log(4 / 3), math.log(2)])


def test_top1_agreement_and_nll_by_hand():
    ref, other = logp([0.6, 0.4], [0.3, 0.7]), logp([0.9, 0.1], [0.8, 0.2])
    assert top1_agreement(ref, other).tolist() == [True, False]
    assert token_nll(other, torch.tensor([1, 0])).tolist() == pytest.approx([-math.log(0.1), -math.log(0.8)])


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    V = 50
    lp = torch.log_softmax(torch.zeros(8, V), -1)
    t = Tally()
    t.add(lp, lp, torch.arange(8))
    assert perplexity(t.nll, t.tokens) == pytest.approx(V)
    assert (t.kl, t.agree, t.tokens) == (0.0, 8, 8)


def test_chunks_follow_llama_perplexity():
    ids = list(range(100, 125))  # 25 tokens: 3 chunks of 8 at most
    assert make_chunks(ids, 8, 6) == [ids[0:8], ids[8:16], ids[16:24]]
    assert make_chunks(ids, 8, 2, bos=1) == [[1, *ids[1:8]], [1, *ids[9:16]]]
    assert list(scored_span(512)) == list(range(256, 511))  # 255 tokens a chunk, as llama.cpp counts
    assert list(scored_span(7)) == [3, 4, 5]


def test_llama_perplexity_log_is_parsed():
    log = ("perplexity: calculating perplexity over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
           "[1]11.2345,[2]12.3456,\nFinal estimate: PPL = 12.3456 +/- 0.54321\n")
    assert parse_llama_log(log) == (12.3456, 2)
    assert parse_llama_log("main: error: failed to load model") == (None, None)


def chunks_of(vocab: int, n: int, ctx: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return make_chunks(torch.randint(0, vocab, (n * ctx,), generator=g).tolist(), ctx, n, bos=0)


def test_float32_vs_int8_on_a_tiny_model():
    """Same seed, same weights: int8 moves the distributions a little (KL > 0), float32's
    own row is the reference (KL 0, agreement 1, PPL +0%)."""
    size = dict(hidden_size=64, intermediate_size=128, vocab_size=64, logit_scale=4.0)
    models = {"float32": tiny_model(seed=1, dtype="float32", **size), "int8": tiny_model(seed=1, dtype="int8", **size)}
    calls = []
    rows = evaluate(models, chunks_of(64, 2, 32), progress=lambda: calls.append(1))
    ref, int8 = rows
    assert [r.label for r in rows] == ["float32", "int8"] and len(calls) == 4
    assert (ref.kl, ref.top1, ref.ppl_vs_ref, ref.tokens) == (0.0, 1.0, 0.0, 2 * 15)
    assert 0 < int8.kl < 0.1 and 0.5 < int8.top1 <= 1.0 and int8.tokens == 30
    assert 1 < ref.ppl < math.inf and int8.ppl_vs_ref == pytest.approx((int8.ppl / ref.ppl - 1) * 100)


def test_a_precision_given_as_a_loader_is_loaded_in_its_turn_with_the_same_row():
    """`forerun quality` hands evaluate a loader per precision (one model besides the
    reference in memory at a time); its row equals the one from the model itself."""
    size = dict(hidden_size=64, intermediate_size=128, vocab_size=64, logit_scale=4.0)
    ref, int8 = tiny_model(seed=1, dtype="float32", **size), tiny_model(seed=1, dtype="int8", **size)
    events = []
    rows = evaluate({"float32": ref, "int8": lambda: events.append("load") or int8}, chunks_of(64, 2, 32),
                    progress=lambda: events.append("chunk"))
    assert events == ["chunk", "chunk", "load", "chunk", "chunk"]  # the reference's chunks, then the loader
    assert rows == evaluate({"float32": ref, "int8": int8}, chunks_of(64, 2, 32))


def test_scored_positions_are_the_teacher_forced_ones():
    """Our PPL equals the one from the model's full teacher-forced logits, scored by hand."""
    model = tiny_model(seed=2, dtype="float64")
    chunks = chunks_of(32, 2, 10)
    nll = 0.0
    for c in chunks:
        lp = torch.log_softmax(model.score(c), -1)  # [10, V]
        nll -= sum(lp[i, c[i + 1]].item() for i in range(5, 9))  # positions 5..8 score tokens 6..9
    assert evaluate({"float64": model}, chunks)[0].ppl == pytest.approx(math.exp(nll / 8), rel=1e-6)


def test_precisions_are_listed_once_after_float32_with_auto_resolved():
    from forerun.bench.commands import _quality_dtypes

    resolve = {"auto": "gguf"}.get
    assert _quality_dtypes("int8, float32,auto,int8,gguf", lambda d: resolve(d, d)) == ["int8", "gguf"]


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float32,int9"], "dtype must be one of"),
    (["--ctx", "2"], "--ctx must be >= 4"),
    (["--text", "/no/such/file.txt"], "--text /no/such/file.txt"),
    (["--llama-cpp-dir", "/no/such/dir"], "no llama-perplexity there"),
])
def test_bad_arguments_are_one_line_errors_before_any_model_loads(capsys, argv, message):
    assert main(["quality", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_quality_command_on_the_embedded_model(capsys, embedded_dir, tmp_path, monkeypatch):
    import json

    from forerun.bench import fidelity

    monkeypatch.setattr(fidelity, "cache_dir", lambda: tmp_path)  # its record goes here, not in the user's cache
    assert main(["quality", "--model", str(embedded_dir), "--dtype", "int8", "--ctx", "64", "--chunks", "2", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "recorded in" in captured.err and fidelity.load(embedded_dir)["int8"]["tokens"] == 2 * 31
    ref, int8 = out["rows"]
    assert out["chunks"] == 2 and out["text"][0].endswith("argparse.py")
    assert (ref["label"], ref["kl"], ref["top1"]) == ("float32", 0.0, 1.0) and ref["tokens"] == 2 * 31
    assert int8["label"] == "int8" and int8["kl"] > 0 and 1 < ref["ppl"] < 100
