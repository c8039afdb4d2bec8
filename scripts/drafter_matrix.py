"""Every training-free drafter x Spec-Bench's six subtasks + HumanEval, one process.

    .venv/bin/python scripts/drafter_matrix.py --limit 3 --max-new-tokens 64 --out matrix.json
    .venv/bin/python scripts/drafter_matrix.py --model qwen2.5-coder-1.5b --dtype int8 \
        --draft-model qwen2.5-coder-0.5b --cross-draft-model smollm2-135m --out qwen-int8.json

Per cell: greedy identity, acceptance rate, mean accepted length, draft cost relative to
one verifier forward, and speedup over forerun's plain decoding at the same precision
(plain and speculative alternate per prompt, same process).
"""
from __future__ import annotations

import argparse
import json
import sys

from forerun.bench.compare import run_pair, summarize
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ForerunError
from forerun.llm import LLM
from forerun.prompts import load_prompts

SETS = ["spec_bench:mt_bench", "spec_bench:translation", "spec_bench:summarization", "spec_bench:qa",
        "spec_bench:math_reasoning", "spec_bench:rag", "humaneval"]


def methods(args) -> dict[str, SpeculativeConfig]:
    """Every training-free drafter; the draft model (and a cross-tokenizer one) when named."""
    out = {
        "ngram k=5": SpeculativeConfig("ngram", 5),
        "ngram tree x3 k=5": SpeculativeConfig("ngram", 5, ngram_branches=3),
        "layer_skip k=3": SpeculativeConfig("layer_skip", 3),
        "early_exit@half k=3": SpeculativeConfig("early_exit", 3),
        "quantized int8 k=4": SpeculativeConfig("quantized", 4),
        "lookahead W5 N3 G4": SpeculativeConfig("lookahead", 5),
    }
    if args.draft_model:
        out["draft_model k=5"] = SpeculativeConfig("draft_model", 5, draft_model=args.draft_model, draft_dtype=args.draft_dtype)
    if args.cross_draft_model:
        out["cross-tokenizer k=4"] = SpeculativeConfig("draft_model", 4, draft_model=args.cross_draft_model,
                                                       draft_dtype=args.draft_dtype)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="verifier (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft-model", default=None, help="adds draft_model k=5 with this drafter")
    ap.add_argument("--cross-draft-model", default=None, help="adds a cross-tokenizer draft model")
    ap.add_argument("--draft-dtype", default=None, help="drafters' precision (default: the verifier's)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the method labels")
    ap.add_argument("--out", default="matrix.json")
    args = ap.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, progress=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    chosen = {k: v for k, v in methods(args).items() if not args.methods or k in args.methods.split(",")}
    results = {}
    for label, spec in chosen.items():
        for s in SETS:
            prompts = load_prompts(s, limit=args.limit)
            try:
                runs = [run_pair(llm, p, params, spec, spec_first=bool(i % 2)) for i, p in enumerate(prompts)]
            except ForerunError as e:  # a drafter that cannot run on this verifier: say why, go on
                results.setdefault(label, {})[s] = {"error": str(e)}
                print(f"{label:22s} {s:28s} error: {e}", flush=True)
                break
            r = summarize(llm, runs, params, spec)
            cell = {
                "identical": r["identical"], "acceptance_rate": r["speculative"]["acceptance_rate"],
                "tau": r["speculative"]["mean_accepted_length"], "speedup": r["speedup"],
                "draft_cost": r["speculative"]["draft_cost_vs_verifier_forward"],
                "plain_tok_s": r["autoregressive"]["tokens_per_s"], "spec_tok_s": r["speculative"]["tokens_per_s"],
            }
            results.setdefault(label, {})[s] = cell
            print(f"{label:22s} {s:28s} ident={cell['identical']} acc={cell['acceptance_rate']:.2f} "
                  f"tau={cell['tau']:.2f} cost={cell['draft_cost'] or 0:.2f} speedup={cell['speedup']:.2f}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
