"""`forerun generate` and `forerun compare`. User errors print one line, never a traceback."""
from __future__ import annotations

import argparse
import json
import sys

from forerun.errors import ForerunError

# A coding-assistant edit: the kind of request whose answer reuses its prompt, where prompt lookup pays.
DEFAULT_PROMPT = (
    "Fix the bug in this Python code and show the full corrected code:\n\n"
    "def find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n < best:\n"
    "            best = n\n    return best"
)
FIXED_TEXT = (
    "Speculative decoding lets a cheap drafter propose several tokens that the large model then checks "
    "in a single forward pass. def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
)


def _common(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="model folder, .gguf file, hub id, or an embedded name: smollm2-135m (default), gemma3-270m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    p.add_argument("--method", default="ngram",
                   help="drafter: ngram, draft_model, layer_skip, early_exit, quantized, lookahead; none = plain")
    p.add_argument("--k", type=int, default=5, help="speculative tokens per step")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft_model")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                   help="draft model's precision (default: the verifier's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-branches", type=int, default=1, help="ngram: verify up to N matches as a token tree")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft_model: score only the first N token ids (+ special tokens) in the drafter's head")
    p.add_argument("--tree-width", type=int, default=1, help="draft_model: candidates at the first position (a tree)")
    p.add_argument("--skip-layers", default=None, help="layer_skip: comma-separated layers (default: tuned profile)")
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: draft with the first N layers")
    p.add_argument("--lookahead-window", type=int, default=5)
    p.add_argument("--lookahead-ngram", type=int, default=3)
    p.add_argument("--lookahead-pool", type=int, default=4)


class _Version(argparse.Action):
    """--version, computed only when asked (it imports torch and may build the int8 kernel)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from forerun.about import describe

        print(describe())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forerun", description="Lossless speculative decoding.")
    parser.add_argument("--version", action=_Version, help="versions, CPU features and the int8 paths in use, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream one completion, then plain vs speculative stats")
    g.add_argument("prompt", nargs="?", default=None, help="the user message (default: a built-in bug-fix request, printed first)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is (no chat template)")
    g.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding run used for the speedup line")
    _common(g)
    c = sub.add_parser("compare", help="plain vs speculative on a prompt set, alternating runs")
    c.add_argument("--prompts", default="spec_bench:mt_bench", help="spec_bench[:subtask], humaneval, svamp, vicuna, or a .jsonl path")
    c.add_argument("--data-dir", default=None, help="prompt data folder (default: $FORERUN_DATA_DIR or ../shared/data/prompts)")
    c.add_argument("--limit", type=int, default=10)
    c.add_argument("--json", action="store_true", help="print one JSON object")
    _common(c)
    t = sub.add_parser("tune-skip", help="search which layers the layer_skip drafter skips; saves a profile")
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    t.add_argument("--prompts", default="vicuna", help="calibration prompts (default: vicuna, minus Spec-Bench overlaps)")
    t.add_argument("--data-dir", default=None)
    t.add_argument("--limit", type=int, default=4)
    t.add_argument("--k", type=int, default=3)
    t.add_argument("--max-skip", type=int, default=None, help="largest skip set tried (default: half the layers)")
    t.add_argument("--confirm", type=int, default=3, help="best estimates confirmed by a timed run")
    t.add_argument("--max-new-tokens", type=int, default=64)
    o = sub.add_parser("cost", help="verifier forward time vs tokens scored at once, per precision; table + PNG plot",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    o.add_argument("--model", default=None, help="model folder, .gguf, or embedded name (default: smollm2-135m)")
    o.add_argument("--dtype", default="float32,int8", help="comma-separated precisions to measure")
    o.add_argument("--tokens", default="1,2,4,6,8,12,16,32", help="comma-separated numbers of tokens scored per forward")
    o.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    o.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    o.add_argument("--plot", default="forerun-cost.png", help="PNG to write ('' for none)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("methods", help="list the speculative methods")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "methods":
            from forerun.drafters import available_methods

            print("\n".join(available_methods()))
            return 0
        commands = {"generate": cmd_generate, "compare": cmd_compare, "tune-skip": cmd_tune_skip, "cost": cmd_cost}
        return commands[args.command](args)
    except ForerunError as e:
        print(f"forerun: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _configs(args):
    from forerun.config import SamplingParams, SpeculativeConfig

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_new_tokens, seed=args.seed,
    )
    method = None if args.method in ("none", "plain") else args.method
    spec = SpeculativeConfig(
        method=method, num_speculative_tokens=args.k, draft_model=args.draft_model, draft_dtype=args.draft_dtype,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min, ngram_branches=args.ngram_branches,
        tree_width=args.tree_width, skip_layers=_int_list(args.skip_layers), exit_layer=args.exit_layer,
        lookahead_window=args.lookahead_window, lookahead_ngram=args.lookahead_ngram,
        lookahead_pool=args.lookahead_pool,
        options={"draft_vocab": args.draft_vocab} if args.draft_vocab else {},
    )
    return params, spec


def _int_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ForerunError(f"expected comma-separated integers, got {text!r}") from None


def _llm(args, spec):
    from forerun.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, speculative=spec)


def cmd_generate(args) -> int:
    params, spec = _configs(args)
    llm = _llm(args, spec)
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
        print(f"prompt (built-in):\n{DEFAULT_PROMPT}\n---", file=sys.stderr, flush=True)
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = llm.generate(prompt, params, stream=lambda i, text: print(text, end="", flush=True))[0]
    print()
    s = out.stats
    label = f"{spec.method}, k={spec.num_speculative_tokens}" if spec.enabled else "plain"
    line = f"[{label}] {s.generated} tokens, {s.tokens_per_s:.1f} tok/s"
    if spec.enabled:
        line += f", acceptance {s.acceptance_rate:.1%}, mean accepted length {s.mean_accepted_length:.2f}"
    if spec.enabled and not args.no_baseline:
        base = llm.generate(prompt, params, speculative=None)[0]
        speedup = base.stats.tokens_per_s and s.tokens_per_s / base.stats.tokens_per_s
        same = "identical" if base.token_ids == out.token_ids else "differs"
        line = (
            f"plain {base.stats.tokens_per_s:.1f} tok/s | speculative ({label}) {s.tokens_per_s:.1f} tok/s | "
            f"speedup {speedup:.2f}x | acceptance {s.acceptance_rate:.1%} | "
            f"mean accepted length {s.mean_accepted_length:.2f}"
            + (f" | output {same}" if params.greedy else "")
        )
    print(line, file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from tqdm import tqdm

    from forerun.bench.compare import run_pair, summarize
    from forerun.prompts import load_prompts

    params, spec = _configs(args)
    if not spec.enabled:
        raise ForerunError("compare needs a speculative method and --k >= 1")
    prompts = load_prompts(args.prompts, limit=args.limit, data_dir=args.data_dir)
    llm = _llm(args, spec)
    runs = [run_pair(llm, p, params, spec, spec_first=bool(i % 2)) for i, p in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr))]
    report = {"prompts": args.prompts, **summarize(llm, runs, params, spec)}
    if args.dtype != "float32":
        report["top1_agreement_vs_float32"] = _agreement_vs_float32(args, llm)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


# Vicuna ids that duplicate Spec-Bench prompts (see the data's SOURCES.md): never tune on them.
SPEC_BENCH_OVERLAP = {"vicuna/64", "vicuna/67", "vicuna/77"}


def cmd_tune_skip(args) -> int:
    from tqdm import tqdm

    from forerun.bench.compare import prompt_ids
    from forerun.bench.tune_skip import confirm, search
    from forerun.config import SamplingParams
    from forerun.drafters.skip_profile import save_profile
    from forerun.llm import LLM
    from forerun.prompts import load_prompts

    if min(args.confirm, args.k, args.limit, args.max_new_tokens) < 1:
        raise ForerunError("--confirm, --k, --limit and --max-new-tokens must be >= 1")
    llm = LLM(model=args.model, dtype=args.dtype, speculative=None)
    prompts = [p for p in load_prompts(args.prompts, data_dir=args.data_dir) if p.id not in SPEC_BENCH_OVERLAP][: args.limit]
    ids = [prompt_ids(llm, p) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    calib = [p + o.token_ids for p, o in zip(ids, llm.generate(ids, greedy, speculative=None))]
    n = llm.model.config.num_hidden_layers
    max_skip = args.max_skip or n // 2
    with tqdm(total=n + max_skip, desc="scoring skip sets", file=sys.stderr) as bar:
        cands = search(llm, calib, args.k, max_skip, progress=bar.update)
    best = confirm(llm, ids[:2], cands[: args.confirm], args.k, max_tokens=48)
    for c in best:
        print(f"skip {len(c.skip):2d} layers: agreement {c.agreement:.1%}, est {c.est_tokens_per_s:.1f} tok/s, "
              f"measured speedup {c.measured_speedup:.2f}x  {c.skip}", file=sys.stderr)
    win = best[0]
    path = save_profile(llm, {
        "model": llm.name, "num_hidden_layers": n, "dtype": args.dtype, "k": args.k, "skip": win.skip,
        "agreement": win.agreement, "est_tokens_per_s": win.est_tokens_per_s,
        "measured_speedup": win.measured_speedup, "calibration": f"{args.prompts} x{len(prompts)}",
    })
    print(f"saved {path}")
    if win.measured_speedup < 1.0:
        print("note: no skip set beat plain decoding in the timed run on this machine", file=sys.stderr)
    return 0


def cmd_cost(args) -> int:
    from forerun.bench.cost import CostCurve, measure, plot
    from forerun.llm import LLM

    tokens = sorted(set(_int_list(args.tokens) or ()) | {1})
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if min(tokens) < 1 or args.context < 1 or args.repeats < 1 or not dtypes:
        raise ForerunError("--tokens, --context and --repeats must be >= 1, and --dtype must name a precision")
    curves = []
    for dtype in dtypes:
        llm = LLM(model=args.model, dtype=dtype, speculative=None)
        print(f"forerun: timing {llm.name} at {dtype} ({len(tokens)} sizes x {args.repeats} rounds)...", file=sys.stderr, flush=True)
        curves.append(CostCurve(llm.name, dtype, args.context, measure(llm.model, tokens, args.context, args.repeats)))
        del llm
    if args.plot:
        plot(curves, args.plot)
    if args.json:
        print(json.dumps([{"model": c.model, "dtype": c.dtype, "context": c.context, "ms": c.ms,
                           "ratio": {t: round(c.ratio(t), 3) for t in c.ms}} for c in curves], indent=2))
    else:
        print("tokens  " + "  ".join(f"{c.dtype:>16}" for c in curves))
        for t in tokens:
            print(f"{t:6d}  " + "  ".join(f"{c.ms[t]:8.1f} ms {c.ratio(t):4.2f}x" for c in curves))
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _agreement_vs_float32(args, llm) -> float:
    from forerun.bench.compare import top1_agreement
    from forerun.llm import LLM

    ref = LLM(model=args.model, dtype="float32", speculative=None, progress=False)
    return top1_agreement(llm.model, ref.model, llm.encode([FIXED_TEXT])[0])


def _print_report(r: dict):
    a, s = r["autoregressive"], r["speculative"]
    print(f"{r['prompts']}: {r['n_prompts']} prompts, {r['method']} k={r['k']}, dtype {r['dtype']}, temperature {r['temperature']}")
    print(f"  plain        {a['tokens_per_s']:7.2f} tok/s  (decode {a['decode_tokens_per_s']:.2f})")
    print(f"  speculative  {s['tokens_per_s']:7.2f} tok/s  (decode {s['decode_tokens_per_s']:.2f})")
    print(f"  speedup {r['speedup']:.2f}x   acceptance {s['acceptance_rate']:.1%}   mean accepted length {s['mean_accepted_length']:.2f}")
    if r["identical"] is not None:
        print(f"  identical to plain: {r['identical']}  (match share {r['match_share']:.0%})")
    for d in r["divergences"]:
        print(f"    {d['id']}: first differs at token {d['position']}, top-2 logit gap {d['top2_logit_gap']:.4f}")
    if "top1_agreement_vs_float32" in r:
        print(f"  top-1 agreement with float32 on a fixed text: {r['top1_agreement_vs_float32']:.1%}")


if __name__ == "__main__":
    sys.exit(main())
