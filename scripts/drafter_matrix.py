"""Every training-free drafter x Spec-Bench's six subtasks + HumanEval, one process: a
`forerun bench` run with a fixed list of drafters (the report, plots and verdicts land in --out).

    .venv/bin/python scripts/drafter_matrix.py --limit 3 --max-new-tokens 64 --out matrix
    .venv/bin/python scripts/drafter_matrix.py --model qwen2.5-coder-1.5b --dtype int8 \
        --draft-model qwen2.5-coder-0.5b --cross-draft-model smollm2-135m --out qwen-int8

Per cell: greedy identity, acceptance rate (and by position), tau beside its prediction,
time split, and speedup over forerun's plain decoding at the same precision (plain and
every drafter interleaved per prompt, same process). A drafter that cannot run on this
verifier (quantized on an int8 verifier, layer_skip without a tune-skip profile) is
reported and left out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forerun.bench.bench import BenchRun, run_bench, save, workloads_from
from forerun.bench.grid import make_methods
from forerun.bench.report import write_reports
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ForerunError
from forerun.llm import LLM

SETS = ["spec_bench:mt_bench", "spec_bench:translation", "spec_bench:summarization", "spec_bench:qa",
        "spec_bench:math_reasoning", "spec_bench:rag", "humaneval"]


def specs(args) -> list[SpeculativeConfig]:
    """Every training-free drafter; the draft model (and a cross-tokenizer one) when named."""
    out = [SpeculativeConfig("ngram", 5), SpeculativeConfig("ngram", 5, ngram_branches=3),
           SpeculativeConfig("layer_skip", 3), SpeculativeConfig("early_exit", 3),
           SpeculativeConfig("quantized", 4), SpeculativeConfig("lookahead", 5)]
    if args.draft_model:
        out.append(SpeculativeConfig("draft_model", 5, draft_model=args.draft_model, draft_dtype=args.draft_dtype))
    if args.cross_draft_model:
        out.append(SpeculativeConfig("draft_model", 4, draft_model=args.cross_draft_model, draft_dtype=args.draft_dtype))
    return out


def runnable(llm: LLM, methods, ids: list[int]):
    """The methods whose drafter builds and runs on this verifier; say why for the others."""
    ok = []
    for m in methods:
        try:
            m.llm.generate([ids[:16]], SamplingParams(temperature=0, max_tokens=2), speculative=m.spec)
            ok.append(m)
        except ForerunError as e:
            print(f"{m.label}: left out: {e}", file=sys.stderr, flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="verifier (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft-model", default=None, help="adds draft_model k=5 with this drafter")
    ap.add_argument("--cross-draft-model", default=None, help="adds a cross-tokenizer draft model (k=4)")
    ap.add_argument("--draft-dtype", default=None, help="drafters' precision (default: the verifier's)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the drafter names (ngram, lookahead, ...)")
    ap.add_argument("--out", default="matrix", help="report folder")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, progress=False)
    chosen = [s for s in specs(args) if not args.methods or s.method in args.methods.split(",")]
    workloads = workloads_from(llm, SETS, args.limit)
    methods = runnable(llm, make_methods(llm, chosen), workloads[0].prompts[0][1])
    meta = {"model": args.model or "smollm2-135m", "dtype": args.dtype, "prompts": ",".join(SETS), "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    run = BenchRun(llm, methods, workloads, SamplingParams(temperature=0, max_tokens=args.max_new_tokens), meta,
                   Path(args.out), args.resume)
    result = run_bench(run)
    write_reports(result, run.out)
    save(result, run.json_path)
    print((run.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
