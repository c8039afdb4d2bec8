"""forerun bench on tiny random models: cells, JSON, --resume, reports; the advisor's
verdicts on synthetic results; drift flagging with a perturbed verifier."""
import json

import pytest

from forerun.bench.advise import advise, batch_estimates, summary_line
from forerun.bench.bench import BenchRun, run_bench
from forerun.bench.cell import summarize_cell
from forerun.bench.grid import Workload, make_methods, run_workload
from forerun.bench.report import write_reports
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.bench.drift import compare, perturb_
from forerun.kernels import loader as kernel_loader
from forerun.errors import ForerunError
from forerun.llm import LLM
from tests.tiny import tiny_model

WORK = [Workload("loops", [("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]), ("b", [5, 6, 5, 6, 5, 6, 5])]),
        Workload("mixed", [("c", [30, 1, 30, 2, 7, 7, 8, 30, 1]), ("d", [9, 9, 9, 9])])]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def bench_run(tmp_path, specs, resume=False) -> BenchRun:
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=2))
    meta = {"model": "tiny", "max_new_tokens": 24}
    return BenchRun(verifier, make_methods(verifier, specs), WORK, GREEDY, meta, tmp_path, resume, progress=False)


def test_bench_cells_json_and_reports(tmp_path):
    run = bench_run(tmp_path, [SpeculativeConfig("ngram", 2), SpeculativeConfig("ngram", "auto", options={"k_max": 4})])
    result = run_bench(run)
    assert [(c["category"], c["method"]) for c in result["cells"]] == [
        ("loops", "ngram k=2"), ("loops", "ngram k=auto"), ("mixed", "ngram k=2"), ("mixed", "ngram k=auto")]
    for c in result["cells"]:
        assert c["identical"] is True and c["n_prompts"] == 2 and c["speedup"] > 0
        assert c["predicted_tau"] >= 1.0 and len(c["acceptance_by_position"]) <= (2 if c["k"] == 2 else 4)
    assert result["cells"][0]["acceptance_by_position"]  # repetitive prompts: the n-gram drafter drafts
    assert json.loads(run.json_path.read_text())["cells"] == result["cells"]
    assert {s["method"] for s in result["samples"]} == {"ngram k=2", "ngram k=auto"}
    written = write_reports(result, tmp_path)
    for name in ("report.md", "report.html", "speedup_by_k.png", "acceptance_by_position.png"):
        assert written[name].stat().st_size > 500
    md = written["report.md"].read_text()
    assert "| loops | ngram k=2 |" in md and "Verdict" in md
    assert 'class="tok o-' in written["report.html"].read_text()


def test_the_report_says_the_precision_fidelity(tmp_path):
    from forerun.bench.fidelity import line_for

    run = bench_run(tmp_path, [SpeculativeConfig("ngram", 2)])
    result = run_bench(run)
    result["fidelity"] = line_for(run.verifier, "tiny")  # as cmd_bench sets it: float32, the reference
    written = write_reports(result, tmp_path)
    assert "Fidelity of float32: the reference" in written["report.md"].read_text()
    assert "fidelity of float32: the reference" in written["report.html"].read_text()


def test_resume_keeps_finished_cells_and_runs_only_new_ones(tmp_path, monkeypatch):
    first = run_bench(bench_run(tmp_path, [SpeculativeConfig("ngram", 2)]))
    calls = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **kw: calls.append(kw.get("speculative")) or real(self, *a, **kw))
    run = bench_run(tmp_path, [SpeculativeConfig("ngram", 2), SpeculativeConfig("ngram", 3)], resume=True)
    result = run_bench(run)
    assert result["cells"][:2] == first["cells"]  # kept as they were
    assert [c["method"] for c in result["cells"][2:]] == ["ngram k=3", "ngram k=3"]
    timed = calls[2:]  # after the warm-up (plain + the one pending method)
    assert len(timed) == 4 * 2  # 4 prompts x (plain + ngram k=3): the finished ngram k=2 never reran
    calls.clear()
    assert run_bench(bench_run(tmp_path, [SpeculativeConfig("ngram", 2)], resume=True))["cells"] == result["cells"]
    assert calls == []  # nothing left to run
    other = bench_run(tmp_path, [SpeculativeConfig("ngram", 2)], resume=True)
    other.meta = {**other.meta, "max_new_tokens": 99}
    with pytest.raises(ForerunError, match="max_new_tokens"):
        run_bench(other)


def cell(cat, method, k, speedup, low, high, acc=0.5, n=5, by_pos=(0.6, 0.4)):
    ts = {"prefill_s": 0.1, "draft_s": 0.05, "verify_s": 1.0, "overhead_s": 0.0}
    from forerun.bench.spread import verdict

    return {"category": cat, "method": method, "k": k, "n_prompts": n, "speedup": speedup, "speedup_ci95": [low, high],
            "verdict": verdict(low, high),
            "tokens_per_s": 10 * speedup, "plain_tokens_per_s": 10.0, "acceptance_rate": acc, "tau": 2.0,
            "predicted_tau": 2.1, "acceptance_by_position": list(by_pos), "drafted_per_step": float(k if k != "auto" else 3),
            "steps": 50, "plain_steps": 100, "time_split": ts, "plain_time_split": ts, "identical": True, "match_share": 1.0}


def test_advisor_verdicts():
    cells = [cell("code", "ngram k=3", 3, 1.40, 1.2, 1.6), cell("code", "ngram k=5", 5, 1.30, 1.1, 1.5),
             cell("chat", "ngram k=3", 3, 1.05, 0.9, 1.2), cell("chat", "ngram k=5", 5, 0.95, 0.85, 1.05),
             cell("math", "ngram k=3", 3, 0.80, 0.70, 0.90),
             cell("qa", "ngram k=5", 5, 1.30, 1.1, 1.5, by_pos=(0.5, 0.4, 0.1, 0.05, 0.0)),
             cell("qa", "ngram k=auto", "auto", 1.26, 1.1, 1.4)]
    adv = {a.category: a for a in advise({"cells": cells})}
    assert adv["code"].use and adv["code"].method == "ngram k=3" and adv["code"].headline == "USE ngram k=3"
    assert not adv["chat"].use and "no measurable gain" in adv["chat"].headline
    assert not adv["math"].use and "slower" in adv["math"].headline
    assert adv["qa"].use and adv["qa"].method == "ngram k=auto"  # within 5% of the best fixed k
    assert any("position 3 onwards" in e for e in adv["qa"].evidence)
    line = summary_line(list(adv.values()))
    assert "code (ngram k=3" in line and "leave it off for chat, math" in line
    few = advise({"cells": [cell("x", "ngram k=3", 3, 1.4, 1.4, 1.4, n=1)]})[0]
    assert "tentative" in few.headline
    stalled = advise({"cells": [cell("x", "ngram k=3", 3, 9.2, 1.2, 17.6)]})[0]
    assert any("very wide" in e for e in stalled.evidence)


def test_batch_estimates_fall_as_the_verifier_turns_compute_bound():
    c = cell("code", "ngram k=3", 3, 1.5, 1.3, 1.7)
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 10.0, 64: 10.0}
    bound = {1: 10.0, 2: 10.5, 4: 11.0, 8: 14.0, 16: 25.0, 32: 50.0, 64: 100.0}
    est_flat, est_bound = batch_estimates(c, flat), batch_estimates(c, bound)
    assert est_flat[1] == pytest.approx(1.5) and est_bound[1] == pytest.approx(1.5)  # anchored on the measurement
    assert est_flat[16] == pytest.approx(1.5)  # memory-bound at every size: the gain holds
    assert est_bound[16] < est_bound[4] < est_bound[1] and est_bound[16] < 1.0
    adv = advise({"cells": [c], "cost_curve": {"ms": {str(t): v for t, v in bound.items()}}})[0]
    assert adv.batch_speedup == est_bound and "batch 16" in adv.text()


def test_drift_flags_a_drafter_that_stopped_fitting():
    old = [cell("code", "draft_model k=3", 3, 1.4, 1.2, 1.6, acc=0.9), cell("chat", "draft_model k=3", 3, 1.2, 1.1, 1.3, acc=0.8)]
    new = [cell("code", "draft_model k=3", 3, 0.8, 0.7, 0.9, acc=0.3), cell("chat", "draft_model k=3", 3, 1.15, 1.0, 1.3, acc=0.5)]
    flags = {f.category: f for f in compare(old, new)}
    assert flags["code"].status == "stopped paying" and "WARNING" in flags["code"].message
    assert flags["chat"].status == "acceptance fell"
    assert compare(old, old)[0].status == "ok"


def test_drift_on_a_perturbed_tiny_verifier():
    """A drafter that is an exact copy of the old verifier: every draft token accepted; the
    same drafter against a perturbed verifier: acceptance falls and the check flags it."""
    greedy = SamplingParams(temperature=0, max_tokens=20)
    acc = {}
    for side, sigma in (("old", 0.0), ("new", 1.0)):
        verifier = LLM(tiny_model(seed=0, num_hidden_layers=2))
        if sigma:
            perturb_(verifier.model, sigma, seed=1)
        drafter = LLM(tiny_model(seed=0, num_hidden_layers=2))  # fitted to the old verifier
        methods = make_methods(verifier, [SpeculativeConfig("draft_model", 3, draft_model=drafter)])
        pairs = run_workload(verifier, methods, WORK[1], greedy)
        acc[side] = [summarize_cell("mixed", m.label, 3, pairs[m.label], True) for m in methods]
        assert all(c["identical"] for c in acc[side])  # lossless either way
    assert acc["old"][0]["acceptance_rate"] == 1.0
    flag = compare(acc["old"], acc["new"])[0]
    assert flag.new_acceptance < 0.7 and flag.status in ("acceptance fell", "stopped paying")


def test_perturb_refuses_integer_weights():
    with pytest.raises(ValueError, match="int8"):
        perturb_(tiny_model(seed=0, dtype="int8"), 0.1)
    if kernel_loader.load() is not None:  # an int4 model holds its weights packed, in no uint8 buffer
        with pytest.raises(ValueError, match="int4"):
            perturb_(tiny_model(seed=0, dtype="int4"), 0.1)
        with pytest.raises(ValueError, match="int4"):  # widths of 256: its Q4_K form (GGUF blocks)
            perturb_(tiny_model(seed=0, dtype="int4", hidden_size=256, intermediate_size=512), 0.1)


def test_cli_grid_options_and_advise(tmp_path, capsys):
    from forerun.bench.commands import specs_from
    from forerun.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--methods", "ngram,lookahead", "--k", "3,auto", "--out", str(tmp_path)])
    specs = specs_from(args)
    assert [(s.method, s.num_speculative_tokens) for s in specs] == [("ngram", 3), ("ngram", "auto"), ("lookahead", 3), ("lookahead", "auto")]
    assert specs[1].options["k_max"] == 8
    with pytest.raises(ForerunError, match="--k"):
        specs_from(build_parser().parse_args(["bench", "--k", "0"]))
    drift = build_parser().parse_args(["drift", "--drafter", "draft_model", "--new-model", "x", "--perturb", "0.2"])
    assert drift.methods == "draft_model" and drift.perturb == 0.2
    report = tmp_path / "bench.json"
    report.write_text(json.dumps({"cells": [cell("code", "ngram k=3", 3, 1.4, 1.2, 1.6)]}))
    assert main(["advise", str(report)]) == 0
    assert "code: USE ngram k=3" in capsys.readouterr().out
    assert main(["advise", str(tmp_path / "missing.json")]) == 2


def test_peers_that_cannot_run_are_skipped_with_the_reason(monkeypatch):
    from forerun.bench.peers import LLAMA_ENV, PeerSetup, run_peers

    monkeypatch.delenv(LLAMA_ENV, raising=False)
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=2))
    setup = PeerSetup([[1, 2, 3, 1, 2]], [""], 8, 3)
    peers = run_peers(verifier, ["transformers", "llama.cpp"], setup)
    assert [r["engine"] for r in peers["rows"]] == ["forerun plain"] and "tokens" not in peers["rows"][0]
    assert any("transformers" in s and "model folder" in s for s in peers["skipped"])
    assert any("llama-bench" in s and "cmake" in s for s in peers["skipped"])


def test_llama_cpp_peer_decodes_after_the_prompts_mean_context(tmp_path):
    """llama-bench runs with -d = the prompts' mean length: forerun decodes after each prompt,
    and llama.cpp's decode rate at no context would be faster than it gets on those prompts."""
    import doctest
    import stat

    from forerun.bench import peers

    assert doctest.testmod(peers).failed == 0
    calls = tmp_path / "calls.txt"
    for name, body in {"llama-bench": f'echo "$@" >> {calls}; echo \'[{{"avg_ts": 12.5}}]\'',
                       "llama-speculative-simple": 'echo "decoded 8 tokens in 0.5 seconds" >&2; echo "accept = 50.0%" >&2'}.items():
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\n{body}\n")
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=2))
    setup = peers.PeerSetup([[1, 2, 3], [4, 5, 6, 7, 8, 9, 1]], ["a", "b"], 8, 3, gguf=gguf, llama_dir=str(tmp_path))
    rows = peers.run_peers(verifier, ["llama.cpp"], setup)["rows"]
    bench = next(r for r in rows if r["engine"].startswith("llama.cpp plain"))
    args = calls.read_text().split()
    assert bench["tokens_per_s"] == 12.5 and args[args.index("-d") + 1] == "5" and "5 tokens of context" in bench["note"]
    assert next(r for r in rows if "lookup" in r["engine"])["tokens_per_s"] == 16.0


def test_advisor_prefers_a_proven_gain_over_a_wider_higher_point():
    cells = [cell("s", "ngram k=5", 5, 1.27, 1.20, 1.38), cell("s", "ngram k=auto", "auto", 1.28, 0.97, 1.68)]
    a = advise({"cells": cells})[0]
    assert a.use and a.method == "ngram k=5"


def test_grid_axes_inside_a_method_and_unique_labels(tmp_path):
    """`--draft-model a,b` and `--ngram-branches 1,3` grid like k; cells that differ only in
    their draft model are named apart by it."""
    from forerun.bench.commands import specs_from
    from forerun.cli import build_parser

    import json

    heads = {}
    for method in ("medusa", "eagle"):  # head folders: each goes to its own method, never to draft_model
        (tmp_path / method).mkdir()
        (tmp_path / method / "head.json").write_text(json.dumps({"format": "forerun-head", "method": method}))
        heads[method] = str(tmp_path / method)
    args = build_parser().parse_args(["bench", "--methods", "ngram,draft_model,lookahead,medusa,eagle", "--k", "3",
                                      "--ngram-branches", "1,3", "--draft-model", f"a,{heads['eagle']},b,{heads['medusa']}"])
    specs = specs_from(args)
    assert [(s.method, s.ngram_branches, s.draft_model) for s in specs] == [
        ("ngram", 1, None), ("ngram", 3, None), ("draft_model", 1, "a"), ("draft_model", 1, "b"), ("lookahead", 1, None),
        ("medusa", 1, heads["medusa"]), ("eagle", 1, heads["eagle"])]  # self drafters read no draft model
    with pytest.raises(ForerunError, match="dflash head folder"):
        specs_from(build_parser().parse_args(["bench", "--methods", "dflash", "--draft-model", f"a,{heads['eagle']}"]))
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=2))
    drafts = [LLM(tiny_model(seed=s, num_hidden_layers=1)) for s in (1, 2)]
    for d, name in zip(drafts, ("small", "smaller")):
        d.name = name
    methods = make_methods(verifier, [SpeculativeConfig("draft_model", 3, draft_model=d) for d in drafts]
                           + [SpeculativeConfig("ngram", 3, ngram_branches=3)])
    assert [m.label for m in methods] == ["draft_model k=3 (small)", "draft_model k=3 (smaller)", "ngram tree x3 k=3"]
    with pytest.raises(ForerunError, match="listed twice"):
        make_methods(verifier, [SpeculativeConfig("ngram", 3)] * 2)
    heads = make_methods(verifier, [SpeculativeConfig("medusa", 3, draft_model=str(tmp_path))])[0]
    assert heads.spec.draft_model == str(tmp_path)  # a head folder stays a path for its drafter to load


def test_bench_leaves_out_a_drafter_that_cannot_run_and_says_why(tmp_path):
    run = bench_run(tmp_path, [SpeculativeConfig("layer_skip", 2), SpeculativeConfig("ngram", 2)])
    result = run_bench(run)
    assert {c["method"] for c in result["cells"]} == {"ngram k=2"}
    assert any(w.startswith("layer_skip k=2 left out: no layer-skip profile") for w in result["warnings"])
    with pytest.raises(ForerunError, match="layer-skip profile"):  # nothing left to run: the error itself
        run_bench(bench_run(tmp_path / "none", [SpeculativeConfig("layer_skip", 2)]))


def test_transformers_peers_include_early_exit_with_same_tokens(embedded_dir):
    """transformers' generate on the embedded model: plain, prompt lookup and the
    self-speculative early exit (assistant_early_exit), all greedy: lossless, so each gives
    forerun's plain tokens (float32, same weights)."""
    from forerun.bench.peers import PeerSetup, run_peers

    verifier = LLM(model=str(embedded_dir), dtype="float32", progress=False)
    ids = verifier.encode([verifier.apply_chat_template([{"role": "user", "content": "Say: red blue red blue"}])])[0]
    peers = run_peers(verifier, ["transformers"], PeerSetup([ids], [""], 8, 3, exit_layer=10))
    rows = {r["engine"]: r for r in peers["rows"]}
    assert list(rows) == ["forerun plain", "transformers plain", "transformers prompt lookup (3)",
                          "transformers early exit (10 of 30 layers)"], peers["skipped"]
    assert all(r["same_tokens"] == "1/1" and r["tokens_per_s"] > 0 for r in rows.values())


def test_exit_layer_of_the_transformers_peer_defaults_to_half_and_is_checked():
    from forerun.bench.commands import _exit_layer
    from forerun.cli import build_parser

    verifier = LLM(tiny_model(seed=0, num_hidden_layers=4))
    assert _exit_layer(build_parser().parse_args(["bench"]), verifier) == 2
    assert _exit_layer(build_parser().parse_args(["bench", "--exit-layer", "3"]), verifier) == 3
    with pytest.raises(ForerunError, match="4 layers"):
        _exit_layer(build_parser().parse_args(["bench", "--exit-layer", "4"]), verifier)


def test_multi_turn_prompts_play_as_sessions():
    """`--turns`: turn 2 resends turn 1 with plain decoding's answer; every method's output is
    plain's, and suffix decoding (its store kept across the runs) drafts on the later turn."""
    from tests.serve_util import tiny_llm

    verifier = tiny_llm("float64")
    first = [{"role": "user", "content": "abcabc"}]
    work = Workload("chat", [("s", verifier.encode([verifier.apply_chat_template(first)])[0])], {"s": ("abcabc", "again")})
    methods = make_methods(verifier, [SpeculativeConfig("suffix", 4), SpeculativeConfig("ngram", 3)])
    pairs = run_workload(verifier, methods, work, GREEDY)
    runs = pairs["suffix k=4"]
    assert [p.prompt_id for p in runs] == ["s", "s#turn2"]
    answer = verifier.decode(runs[0].plain_tokens)
    history = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
    expected = verifier.generate([verifier.apply_chat_template(history)], GREEDY, speculative=None)[0].token_ids
    assert runs[1].plain_tokens == expected
    for label in pairs:
        assert all(p.spec_tokens == p.plain_tokens for p in pairs[label])
    assert runs[1].spec.accepted > 0


def test_multi_turn_rows_keep_their_turns(tmp_path):
    from forerun.bench.bench import workloads_from
    from tests.serve_util import tiny_llm

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"turns": ["one", "two", "three"], "id": "x"}) + "\n" + json.dumps({"turns": ["solo"]}) + "\n")
    llm = tiny_llm("float64")
    assert workloads_from(llm, [str(path)], 5)[0].sessions == {}
    assert workloads_from(llm, [str(path)], 5, turns=2)[0].sessions == {"x": ("one", "two")}
