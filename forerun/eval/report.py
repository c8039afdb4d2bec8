"""An evaluation's report on disk: report.json (every figure, each problem's completion) and
report.md (the totals and a table of problems), in a folder of their own."""
from __future__ import annotations

import json
import time
from pathlib import Path

TOTALS = [("pass@1", "pass@1"), ("passed", "passed"), ("problems", "problems"), ("model", "model"),
          ("dtype", "dtype"), ("method", "method"), ("k", "k"), ("max_new_tokens", "max new tokens"),
          ("seconds", "time (s)"), ("generate_seconds", "generating (s)"), ("test_seconds", "testing (s)"),
          ("tokens", "tokens"), ("tokens_per_s", "tokens/s"), ("acceptance_rate", "acceptance"),
          ("mean_accepted_length", "mean accepted length"), ("fidelity", "fidelity of the precision")]


def default_out(report: dict) -> Path:
    """<forerun's cache>/eval/<task>-<model>-<dtype>-<method>[-k<k>]-<date-time>: never the checkout."""
    from forerun.cache import cache_dir

    label = report["method"] + (f"-k{report['k']}" if report.get("k") is not None else "")
    name = f"{report['task']}-{report['model']}-{report['dtype']}-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cache_dir() / "eval" / name.replace("/", "_")


def write(report: dict, out: Path) -> tuple[Path, Path]:
    """report.json and report.md in `out` (made if needed); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "report.json", out / "report.md"
    js.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    md.write_text(markdown(report), encoding="utf-8")
    return js, md


def markdown(report: dict) -> str:
    lines = [f"# {report['task']}: pass@1 {report['pass@1']:.1%} ({report['passed']}/{report['problems']})", "",
             "| | |", "|---|---|"]
    lines += [f"| {label} | {_cell(report[key])} |" for key, label in TOTALS if report.get(key) is not None]
    lines += ["", "| problem | passed | error | last line of stderr | tokens | seconds |", "|---|---|---|---|---|---|"]
    for r in report["per_problem"]:
        lines.append(f"| {r['task_id']} | {'yes' if r['passed'] else 'no'} | {r['error'] or ''} | "
                     f"{_cell(r['detail'][:120])} | {r['tokens']} | {r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")
