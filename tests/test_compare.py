"""`forerun compare` is a one-cell bench: the same interleaving, the same cell figures, plus
where greedy outputs part; and the command end to end on the embedded model."""
import json

import pytest

from forerun.bench.bench import run_bench
from forerun.bench.cell import PairRun
from forerun.bench.compare import divergences, report_lines, run_compare
from forerun.bench.grid import Workload
from forerun.cli import main
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ForerunError
from forerun.llm import LLM
from forerun.metrics import SpecStats
from tests.test_bench import WORK, bench_run
from tests.tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_compare_runs_the_bench_cell_interleaved(monkeypatch, tmp_path):
    calls = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **kw: calls.append(kw.get("speculative")) or real(self, *a, **kw))
    llm = LLM(tiny_model(seed=0, num_hidden_layers=2))
    spec = SpeculativeConfig("ngram", 2)
    work = Workload("loops", WORK[0].prompts + WORK[1].prompts)
    cell = run_compare(llm, work, GREEDY, spec, progress=False)
    timed = ["plain" if s is None else s.method for s in calls[2:]]  # after the warm-up (plain, ngram)
    assert timed == ["plain", "ngram", "ngram", "plain"] * 2  # plain first on even prompts, speculative on odd
    assert cell["method"] == "ngram k=2" and cell["n_prompts"] == 4 and cell["identical"] is True
    assert cell["divergences"] == [] and cell["speedup"] > 0 and cell["decode_tokens_per_s"] > 0
    assert cell["acceptance_by_position"] and cell["tau"] >= 1.0
    bench_cell = run_bench(bench_run(tmp_path, [spec]))["cells"][0]
    assert set(cell) - {"divergences"} == set(bench_cell)  # the bench's figures, nothing computed apart


def test_divergences_name_the_position_and_the_logit_gap():
    llm = LLM(tiny_model(seed=0, num_hidden_layers=2))
    plain = llm.generate([[1, 2, 3]], GREEDY, speculative=None)[0].token_ids
    other = plain[:3] + [(plain[3] + 1) % 32] + plain[4:]
    pairs = [PairRun("same", SpecStats(), SpecStats(), plain, plain), PairRun("x", SpecStats(), SpecStats(), plain, other)]
    (d,) = divergences(llm, {"same": [1, 2, 3], "x": [1, 2, 3]}, pairs)
    assert d["id"] == "x" and d["position"] == 3 and d["top2_logit_gap"] > 0


def test_compare_refuses_a_drafter_that_cannot_run():
    llm = LLM(tiny_model(seed=0, num_hidden_layers=2))
    with pytest.raises(ForerunError, match="layer_skip k=2: no layer-skip profile"):
        run_compare(llm, WORK[0], GREEDY, SpeculativeConfig("layer_skip", 2), progress=False)


def test_compare_command_on_the_embedded_model(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["Say: one two one two one two", "Count to five."]))
    assert main(["compare", "--prompts", str(prompts), "--k", "3", "--max-new-tokens", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompts"] == str(prompts) and r["method"] == "ngram k=3" and r["n_prompts"] == 2
    assert r["identical"] is True and r["max_new_tokens"] == 8 and len(r["per_prompt"]) == 2
    text = "\n".join(report_lines(r))
    assert "2 prompts, ngram k=3, dtype gguf" in text and "95% interval over prompts" in text
    assert "identical to plain: True" in text and "top-1 agreement with float32" in text
