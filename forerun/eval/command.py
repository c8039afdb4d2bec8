"""`forerun eval <task>`: its parsers and the command (forerun/cli.py registers them). Imports
stay inside the command so that `forerun --help` does not load torch."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from forerun.errors import ForerunError


def register(sub, kit) -> None:
    """`eval` and its tasks (cli_args.CommandKit: the shared model / sampling / drafter flags)."""
    fmt, common = kit.fmt, kit.add_common
    e = sub.add_parser("eval", formatter_class=fmt, help="task accuracy: HumanEval pass@1, plain or speculative")
    tasks = e.add_subparsers(dest="task", metavar="TASK", required=True)
    h = tasks.add_parser("humaneval", formatter_class=fmt,
                         help="pass@1 of greedy chat completions on HumanEval, each run against its tests in a sandbox")
    common(h)
    h.set_defaults(method="none", max_new_tokens=384)  # the model's own pass@1 unless a drafter is asked for
    h.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    h.add_argument("--data-dir", default=None,
                   help="prompt data folder (default: $FORERUN_DATA_DIR or ../shared/data/prompts)")
    h.add_argument("--timeout", type=float, default=10.0, help="seconds each program may run (its CPU time: this + 1)")
    h.add_argument("--memory-gb", type=float, default=2.0, help="address space each program may use, in GB")
    h.add_argument("--out", default=None, help="folder for report.json and report.md "
                   "(default: <forerun cache>/eval/humaneval-<model>-<dtype>-<method>-<time>)")
    h.add_argument("--json", action="store_true", help="print the report's JSON (with pass@1) instead of a summary")
    h.add_argument("--no-progress", action="store_true", help="no progress bar")
    h.set_defaults(flag_parser=h, handler=cmd_eval)  # errors worded in these flags: main() knows only `eval`'s parser


def cmd_eval(args) -> int:
    from forerun.cli_args import in_flags

    try:
        return _humaneval(args)
    except ForerunError as e:
        raise ForerunError(in_flags(str(e), args.flag_parser)) from None


def _humaneval(args) -> int:
    from forerun.bench.fidelity import line_for
    from forerun.cli_args import configs, load_llm
    from forerun.eval.humaneval import evaluate, load_problems, summarize
    from forerun.eval.report import default_out, write
    from forerun.eval.sandbox import Limits

    if min(1 if args.limit is None else args.limit, args.max_new_tokens) < 1 or min(args.timeout, args.memory_gb) <= 0:
        raise ForerunError("--limit, --max-new-tokens, --timeout and --memory-gb must be positive")
    params, spec = configs(args)
    problems = load_problems(args.data_dir, args.limit)
    llm = load_llm(args, spec)
    limits = Limits(timeout_s=args.timeout, memory_bytes=int(args.memory_gb * (1 << 30)))
    start = time.perf_counter()
    results, stats = evaluate(llm, problems, params, spec, limits, progress=not args.no_progress)
    run = {"model": llm.name, "dtype": llm.dtype, "method": spec.method if spec.enabled else "plain",
           "k": spec.num_speculative_tokens if spec.enabled else None, "max_new_tokens": params.max_tokens,
           "temperature": params.temperature, "timeout_s": limits.timeout_s, "memory_bytes": limits.memory_bytes}
    report = summarize(results, stats, run, time.perf_counter() - start)
    report["fidelity"] = line_for(llm, args.model)
    out = Path(args.out).expanduser() if args.out else default_out(report)
    js, md = write(report, out)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_summary(report))
    print(f"report: {js} and {md.name}", file=sys.stderr)
    return 0


def _summary(r: dict) -> str:
    label = r["method"] + (f", k={r['k']}" if r["k"] is not None else "")
    line = (f"humaneval pass@1 {r['pass@1']:.1%} ({r['passed']}/{r['problems']}) | {r['model']} {r['dtype']} "
            f"[{label}] | {r['seconds']:.0f} s, {r['tokens']} tokens, {r['tokens_per_s']:.1f} tok/s")
    if "acceptance_rate" in r:
        line += f" | acceptance {r['acceptance_rate']:.1%}, mean accepted length {r['mean_accepted_length']:.2f}"
    return line + (f"\n{r['fidelity']}" if r.get("fidelity") else "")
