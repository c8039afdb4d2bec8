"""Self-distillation data: requests built from allowed text, answered by the verifier, rows
that `forerun train` reads; resumable; refusals."""
import json

import pytest

from forerun.cli import build_parser
from forerun.config import SamplingParams
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.train import data, instructions
from forerun.train.distill import distill, done_rows
from tests.test_train import CharTokenizer
from tests.tiny import tiny_model

SOURCE = '''"""A module.

This module keeps small helpers for numbers that come up again and again in the code of a
project, and it explains at some length why each of them exists, which inputs they accept,
and what they return when the inputs are outside the expected range of values.
"""


def clamp(x, lo, hi):
    """Limit x to the closed interval [lo, hi].

    Args:
        x: the value
    """
    return max(lo, min(hi, x))


def _hidden(x):
    """Private helpers are not turned into requests at all."""
    return x
'''

README = """Title
=====

Install it with pip, then read the guide. The guide walks through every part of the library in
order, from the first steps of setting up a project to the last steps of shipping it, with a worked
example in each chapter and a summary of what to remember at the end of each one of them.

.. note:: markup lines are dropped

Args: an API paragraph like this one is not prose a user would ask about in a chat, so it is left
out of the requests even when it is long enough to pass the length test for a paragraph of text.
"""


@pytest.fixture()
def sources(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "helpers.py").write_text(SOURCE)
    (root / "README.rst").write_text(README)
    return str(root)


def test_snippets_of_code_and_prose(sources):
    snips = instructions.snippets([sources], want=10, seed=0)
    code = [s for s in snips if s.kind == "code"]
    prose = [s for s in snips if s.kind == "prose"]
    assert [s.fields["sig"] for s in code] == ["clamp(x, lo, hi)"]
    assert code[0].fields["doc"] == "limit x to the closed interval [lo, hi]"
    assert code[0].fields["src"].startswith("def clamp") and "_hidden" not in code[0].fields["src"]
    paras = sorted(s.fields["para"][:12] for s in prose)
    assert paras == ["Install it w", "This module "]  # markup and the Args: paragraph are left out
    assert [s.fields["topic"] for s in prose if s.fields["para"].startswith("Install")] == ["Title"]


def test_requests_are_seeded_and_mixed(sources):
    a = instructions.requests([sources], 40, seed=3)
    assert a == instructions.requests([sources], 40, seed=3) and len(a) == 40
    assert a != instructions.requests([sources], 40, seed=4)
    assert any("clamp(x, lo, hi)" in r for r in a) and any("Install it with pip" in r for r in a)
    maths = instructions.requests([sources], 20, seed=0, math_share=1.0, general_share=0.0)
    assert all(any(item in r for item in instructions.ITEMS + ("pages", "km")) for r in maths)
    everyday = instructions.requests([sources], 20, seed=0, math_share=0.0, general_share=1.0)
    assert all(any(t in r for t in instructions.TOPICS) for r in everyday)


def test_requests_refuse_benchmark_sets(tmp_path, monkeypatch):
    bench = tmp_path / "prompts"
    bench.mkdir()
    (bench / "q.py").write_text(SOURCE)
    monkeypatch.setenv("FORERUN_DATA_DIR", str(bench))
    with pytest.raises(ConfigError, match="benchmark"):
        instructions.requests([str(bench)], 4, seed=0)


class ChatCharTokenizer(CharTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "U" + messages[-1]["content"] + "A"


def test_distill_writes_rows_train_reads_and_resumes(tmp_path):
    llm = LLM(tiny_model(seed=0), tokenizer=ChatCharTokenizer())
    asks = ["ABC", "DEFG", "HI", "JKLMN", "OP"]
    out = tmp_path / "answers.jsonl"
    params = SamplingParams(temperature=0, max_tokens=6)
    tokens = distill(llm, asks[:3], out, params, batch=2)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == asks[:3] and tokens == sum(len(r["response"]) for r in rows)
    plain = llm.generate(["U" + a + "A" for a in asks[:3]], params, speculative=None)
    assert [r["text"] for r in rows] == ["U" + a + "A" + o.text for a, o in zip(asks[:3], plain)]
    assert data.read_texts(out) == [r["text"] for r in rows]  # what `forerun train --data` reads

    with out.open("a") as f:
        f.write('{"text": "torn')  # a run killed mid-write
    assert done_rows(out) == 3 and len(out.read_text().splitlines()) == 3
    distill(llm, asks[done_rows(out):], out, params, batch=2)
    assert [json.loads(x)["prompt"] for x in out.read_text().splitlines()] == asks


def test_cli_flags_and_refusals(tmp_path, sources):
    args = build_parser().parse_args(["distill", "--data", sources, "--out", str(tmp_path / "a.jsonl"), "--count", "3"])
    assert args.count == 3 and args.batch == 8 and args.temperature == 0.0
    from forerun.cli import main

    assert main(["distill", "--data", sources, "--out", str(tmp_path / "a.jsonl"), "--math-share", "0.8",
                 "--general-share", "0.5"]) == 2
    assert main(["distill", "--data", sources, "--out", str(tmp_path / "a.jsonl"), "--count", "0"]) == 2
    assert not (tmp_path / "a.jsonl").exists()
