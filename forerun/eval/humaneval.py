"""HumanEval pass@1 (`forerun eval humaneval`): one greedy completion per problem, run against
the problem's own tests in a sandboxed child process (forerun/eval/sandbox.py).

Prompting. The models forerun serves are chat models, so each problem's `prompt` (imports, the
signature and its docstring) goes into one user message, `INSTRUCTION` then the prompt in a
```python block, rendered by the model's chat template (`LLM.apply_chat_template`, as
`forerun generate` and the chat prompt sets do).

Extraction (`extract_code`), from the completion's text:
1. the fenced blocks (```python, ```py or a bare ```; a block cut off by the token limit runs
   to the end of the text): the first that defines the entry point (a `def name(` line), else
   the first block; without a fence, the whole completion;
2. if that code defines the entry point, the prompt's text before its own `def name(` comes
   first: its imports and the helper functions the docstring relies on (HumanEval/10's
   `is_palindrome`), which models often leave out; a helper the model defines again wins, as it
   comes later. Otherwise the code is taken as a body that continues the docstring: the whole
   prompt, then the code.
The program run is that code, the problem's `test` (it defines `check`), then `check(name)`;
a problem passes when the program exits with status 0 within the time limit.

Speculative decoding does not change a greedy completion, so it does not change pass@1
(tests/test_eval_humaneval.py runs the same problems plain and with n-gram speculation).
"""
from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass

from forerun.errors import ForerunError
from forerun.eval.sandbox import Limits, run_python

INSTRUCTION = ("Complete the following Python function. Reply with the whole function, imports included, "
               "in one ```python code block.")
FENCE = re.compile(r"^```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:^```|\Z)", re.S | re.M | re.I)


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/0"
    prompt: str  # imports, the signature and its docstring
    test: str  # defines check(candidate)
    entry_point: str  # the function check() is given


@dataclass(frozen=True)
class Result:
    task_id: str
    passed: bool
    error: str | None  # None if passed, else the sandbox's kind: "AssertionError", "timeout", ...
    detail: str  # the last line of the program's stderr
    tokens: int  # generated
    seconds: float  # generating (prefill + decode)
    test_seconds: float  # running the program
    completion: str  # the model's text, as generated


def load_problems(data_dir=None, limit: int | None = None) -> list[Problem]:
    """The HumanEval problems in file order (the first `limit`), from the prompt data folder."""
    from forerun.prompts import records

    problems = []
    for i, row in enumerate(records("humaneval", data_dir), start=1):
        fields = [row.get(name) for name in ("task_id", "prompt", "test", "entry_point")]
        if not all(isinstance(f, str) for f in fields):
            raise ForerunError(f"HumanEval record {i}: task_id, prompt, test and entry_point must be strings")
        problems.append(Problem(*fields))
    return problems if limit is None else problems[:limit]


def chat_message(problem: Problem) -> str:
    return f"{INSTRUCTION}\n\n```python\n{problem.prompt.rstrip()}\n```"


def extract_code(completion: str, prompt: str, entry_point: str) -> str:
    """The code to run for a completion (the rule in the module docstring).
    >>> prompt = "import math\\n\\ndef f(x):\\n    '''Twice x.'''\\n"
    >>> extract_code("Here:\\n```python\\ndef f(x):\\n    return 2 * x\\n```\\nDone.", prompt, "f")
    'import math\\n\\ndef f(x):\\n    return 2 * x\\n'
    >>> extract_code("    return 2 * x\\n", prompt, "f") == prompt + "    return 2 * x\\n"
    True
    """
    defines = re.compile(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.M)
    blocks = FENCE.findall(completion)
    code = next((b for b in blocks if defines.search(b)), blocks[0] if blocks else completion)
    if not defines.search(code):
        return prompt + code
    head = re.search(rf"^def[ \t]+{re.escape(entry_point)}[ \t]*\(", prompt, re.M)
    return (prompt[: head.start()] if head else "") + code


def program(problem: Problem, completion: str) -> str:
    code = extract_code(completion, problem.prompt, problem.entry_point)
    return f"{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def evaluate(llm, problems: list[Problem], params, spec, limits: Limits = Limits(), progress: bool = True):
    """(one Result per problem, the merged SpecStats): each problem generated alone (batch 1),
    then its program run in the sandbox while the next waits."""
    from tqdm import tqdm

    from forerun.metrics import merge

    results, stats = [], []
    bar = tqdm(problems, desc="humaneval", unit="problem", file=sys.stderr, disable=not progress)
    for p in bar:
        text = llm.apply_chat_template([{"role": "user", "content": chat_message(p)}])
        out = llm.generate(text, params, speculative=spec)[0]
        run = run_python(program(p, out.text), limits)
        results.append(Result(p.task_id, run.passed, run.error, run.detail, out.stats.generated,
                              out.stats.wall_time, run.seconds, out.text))
        stats.append(out.stats)
        bar.set_postfix(passed=f"{sum(r.passed for r in results)}/{len(results)}")
    return results, merge(stats)


def summarize(results: list[Result], stats, run: dict, seconds: float) -> dict:
    """The report: `run` (model, dtype, method, k, ...), the totals, then one entry per problem.
    pass@1 = passed / problems (one greedy sample each)."""
    passed = sum(r.passed for r in results)
    report = {
        "task": "humaneval", "pass@1": passed / len(results) if results else 0.0, "passed": passed,
        "problems": len(results), **run, "seconds": round(seconds, 2),
        "generate_seconds": round(stats.wall_time, 2), "test_seconds": round(sum(r.test_seconds for r in results), 2),
        "tokens": stats.generated, "tokens_per_s": round(stats.tokens_per_s, 2),
    }
    if stats.drafted:
        report.update(drafted=stats.drafted, accepted=stats.accepted, acceptance_rate=round(stats.acceptance_rate, 4),
                      mean_accepted_length=round(stats.mean_accepted_length, 3))
    report["instruction"] = INSTRUCTION
    report["per_problem"] = [asdict(r) for r in results]
    return report
