"""`forerun eval humaneval`: the code extraction rule, the real tests passing a real solution, and
pass@1 equal with and without speculation (identical completions) on the embedded model."""
import json

import pytest

from forerun.cli import main
from forerun.eval.humaneval import Problem, extract_code, load_problems, program
from forerun.eval.report import markdown
from forerun.eval.sandbox import run_python
from forerun.prompts import data_dir, records

# HumanEval is not bundled (provenance): the tests that read it skip where the data folder lacks it.
needs_humaneval = pytest.mark.skipif(not (data_dir(None) / "HumanEval.jsonl.gz").is_file(),
                                     reason="HumanEval.jsonl.gz is not in the data folder (--data-dir / $FORERUN_DATA_DIR)")

PROMPT = "from typing import List\n\n\ndef double(xs: List[int]) -> List[int]:\n    \"\"\"Each doubled.\"\"\"\n"
BODY = "    return [2 * x for x in xs]\n"
FUNCTION = "def double(xs: List[int]) -> List[int]:\n" + BODY
HEADER = "from typing import List\n\n\n"


@pytest.mark.parametrize("completion, code", [
    # a python block that defines the entry point: the prompt's imports, then the block
    (f"Sure!\n```python\n{FUNCTION}```\nIt doubles.", HEADER + FUNCTION),
    # the first block that defines it, not an example block before it
    (f"```python\nprint(double([1]))\n```\n```py\n{FUNCTION}```", HEADER + FUNCTION),
    # no block defines it: the first block, taken as the body
    (f"```python\n{BODY}```\n```\nprint(1)\n```", PROMPT + BODY),
    # a bare fence, and a block cut off by the token limit
    (f"```\n{FUNCTION}```", HEADER + FUNCTION),
    (f"```python\n{FUNCTION}    # and then", HEADER + FUNCTION + "    # and then"),
    # no fence: the raw text, a whole function or a body
    (FUNCTION, HEADER + FUNCTION),
    (BODY, PROMPT + BODY),
])
def test_extract_code(completion, code):
    assert extract_code(completion, PROMPT, "double") == code


def test_helpers_of_the_prompt_stay_when_the_model_redefines_only_the_entry_point():
    prompt = "def helper(s):\n    return s[::-1]\n\n\ndef main(s):\n    \"\"\"Uses helper.\"\"\"\n"
    code = extract_code("```python\ndef main(s):\n    return helper(s) + s\n```", prompt, "main")
    assert code.startswith("def helper(s):") and code.count("def main(") == 1


@needs_humaneval
def test_the_canonical_solutions_pass_and_a_wrong_one_fails():
    problems = load_problems(limit=3)
    assert [p.task_id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    canonical = [row["canonical_solution"] for row in records("humaneval")][:3]
    for p, body in zip(problems, canonical):
        out = run_python(program(p, body))  # a body, continuing the prompt
        assert out.passed, (p.task_id, out.detail)
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    assert run_python(program(problems[0], wrong)).error == "AssertionError"


@needs_humaneval
def test_speculation_gives_the_same_completions_and_pass_at_1(tmp_path, capsys):
    reports = {}
    for name, flags in [("plain", []), ("ngram", ["--method", "ngram", "--k", "4"])]:
        out = tmp_path / name
        assert main(["eval", "humaneval", "--limit", "2", "--max-new-tokens", "24", "--json", "--no-progress",
                     "--out", str(out), *flags]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
        assert json.loads((out / "report.json").read_text()) == reports[name]
        assert (out / "report.md").read_text() == markdown(reports[name])
    plain, spec = reports["plain"], reports["ngram"]
    assert plain["method"] == "plain" and plain["k"] is None and "acceptance_rate" not in plain
    assert spec["method"] == "ngram" and spec["k"] == 4 and spec["drafted"] > 0
    assert [r["completion"] for r in plain["per_problem"]] == [r["completion"] for r in spec["per_problem"]]
    assert plain["pass@1"] == spec["pass@1"] and plain["problems"] == spec["problems"] == 2
    assert [r["task_id"] for r in plain["per_problem"]] == ["HumanEval/0", "HumanEval/1"]
    assert all(r["tokens"] <= 24 for r in plain["per_problem"]) and plain["max_new_tokens"] == 24


@needs_humaneval
def test_the_problem_fields_come_from_the_file():
    (p,) = load_problems(limit=1)
    assert isinstance(p, Problem) and p.entry_point == "has_close_elements" and "def check(candidate)" in p.test
