"""The `forerun` command: its parsers, `generate`, `tune-skip` and `cost` (compare, bench, advise,
drift and serve live beside their code). User errors print one line, never a traceback."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from forerun.cli_args import (DTYPES, MODELS, CommandKit, HelpFormatter, Parser, add_common, configs, in_flags, int_list,
                              load_llm, near_miss)
from forerun.errors import ForerunError

# A coding-assistant edit: the kind of request whose answer reuses its prompt, where prompt lookup pays.
DEFAULT_PROMPT = (
    "Fix the bug in this Python code and show the full corrected code:\n\n"
    "def find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n < best:\n"
    "            best = n\n    return best"
)

PROMPT_SETS = ("spec_bench[:mt_bench|translation|summarization|qa|math_reasoning|rag], humaneval, svamp, vicuna, "
               "or a .jsonl path; read from --data-dir, else $FORERUN_DATA_DIR, else ../shared/data/prompts")
# Where a command's files go unless told: one folder in the current one, named so it is plainly forerun's
# (the checkout's .gitignore lists it).
RUNS_DIR = "forerun-runs"


class _Version(argparse.Action):
    """--version, computed only when asked (it imports torch and may build the int8 kernel)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from forerun.about import describe

        print(describe())
        parser.exit()


# The modules that add commands, each by its own `register(sub, kit)` (cli_args.CommandKit):
# this one (generate, compare, tune-skip, cost, methods), then bench, train, eval and serve.
COMMAND_MODULES = ("forerun.cli", "forerun.bench.commands", "forerun.train.command", "forerun.train.distill",
                   "forerun.eval.command", "forerun.serve.flags")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(prog="forerun", description="Lossless speculative decoding.", formatter_class=HelpFormatter)
    parser.add_argument("--version", action=_Version, help="versions, CPU features and the kernel paths in use, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    kit = CommandKit(HelpFormatter, add_common, RUNS_DIR)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, kit)
    return parser


def register(sub, kit: CommandKit) -> None:
    """generate, compare, tune-skip, cost and methods."""
    fmt = kit.fmt
    g = sub.add_parser("generate", formatter_class=fmt, help="stream one completion, then plain vs speculative stats")
    g.add_argument("prompt", nargs="?", default=None, help="the user message (default: a built-in bug-fix request, printed first)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is (no chat template)")
    g.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding runs used for the speedup line")
    g.add_argument("--repeats", type=int, default=2, help="timed plain/speculative pairs behind the speedup line (alternating)")
    g.add_argument("--show-drafts", action="store_true",
                   help="print the output coloured by where each token came from (accepted draft, recovered, bonus)")
    kit.add_common(g)
    g.set_defaults(handler=cmd_generate)
    c = sub.add_parser("compare", formatter_class=fmt, help="plain vs speculative on a prompt set, alternating runs")
    c.add_argument("--prompts", default="spec_bench:mt_bench", help=PROMPT_SETS)
    c.add_argument("--data-dir", default=None, help="prompt data folder (default: $FORERUN_DATA_DIR or ../shared/data/prompts)")
    c.add_argument("--limit", type=int, default=10, help="first N prompts of the set")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    kit.add_common(c)
    c.set_defaults(handler=cmd_compare)
    t = sub.add_parser("tune-skip", formatter_class=fmt, help="search which layers the layer_skip drafter skips; saves a profile")
    t.add_argument("--model", default=None, help=MODELS)
    t.add_argument("--dtype", default="auto", choices=DTYPES, help="verifier precision (auto: gguf for a quantized GGUF model, else float32)")
    t.add_argument("--prompts", default="vicuna", help="calibration prompts (Spec-Bench overlaps are left out)")
    t.add_argument("--data-dir", default=None, help="prompt data folder (default: $FORERUN_DATA_DIR or ../shared/data/prompts)")
    t.add_argument("--limit", type=int, default=4, help="calibration prompts used")
    t.add_argument("--k", type=int, default=3, help="draft length the skip set is tuned for")
    t.add_argument("--max-skip", type=int, default=None, help="largest skip set tried (default: half the layers)")
    t.add_argument("--confirm", type=int, default=3, help="best estimates confirmed by a timed run")
    t.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per calibration prompt")
    t.set_defaults(handler=cmd_tune_skip)
    o = sub.add_parser("cost", formatter_class=fmt, help="verifier forward time vs tokens scored at once, per precision; table + PNG plot")
    o.add_argument("--model", default=None, help=MODELS)
    o.add_argument("--dtype", default="float32,int8", help="comma-separated precisions to measure")
    o.add_argument("--tokens", default="1,2,4,6,8,12,16,32", help="comma-separated numbers of tokens scored per forward")
    o.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    o.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    o.add_argument("--plot", default=f"{kit.runs_dir}/cost.png", help="PNG to write, its folder made if needed ('' for none)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.set_defaults(handler=cmd_cost)
    m = sub.add_parser("methods", formatter_class=fmt, help="list the speculative methods: kind, what drafts, the settings each reads")
    m.set_defaults(handler=cmd_methods)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `forerun`: say what there is
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except ForerunError as e:  # worded in the flags the user typed (--max-new-tokens, not max_tokens)
        print(f"forerun: error: {in_flags(str(e), _subparser(parser, args.command))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def cmd_methods(args) -> int:
    from forerun.methods import lines

    print("\n".join(lines()))
    return 0


def cmd_compare(args) -> int:
    from forerun.bench.compare import cmd_compare as run  # (imports torch: only when asked)

    return run(args)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def cmd_generate(args) -> int:
    from forerun.bench.fidelity import line_for

    params, spec = configs(args)
    if args.repeats < 1:
        raise ForerunError("--repeats must be >= 1")
    if args.prompt is not None:
        check_prompt(args.prompt)  # before the model loads
    llm = load_llm(args, spec)
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
        print(f"prompt (built-in):\n{DEFAULT_PROMPT}\n---", file=sys.stderr, flush=True)
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    if args.show_drafts:  # coloured after the fact: a token's colour is known once its step is verified
        out = llm.generate(prompt, params)[0]
        _show_drafts(llm, out)
    else:
        out = llm.generate(prompt, params, stream=lambda i, text: print(text, end="", flush=True))[0]
        print()
    if out.finish_detail == "context":
        print(f"forerun: stopped after {len(out.token_ids)} tokens at the model's {llm.max_context}-token context "
              f"(asked for {params.max_tokens})", file=sys.stderr)
    s = out.stats
    label = f"{spec.method}, k={spec.num_speculative_tokens}" if spec.enabled else "plain"
    line = f"[{label}] {s.generated} tokens, {s.tokens_per_s:.1f} tok/s"
    if spec.enabled:
        line += f", acceptance {s.acceptance_rate:.1%}, mean accepted length {s.mean_accepted_length:.2f}"
    if spec.enabled and not args.no_baseline:
        line = _speedup_line(llm, prompt, params, out, label, args.repeats)
    print(line, file=sys.stderr)
    print(f"forerun: {line_for(llm, args.model)}", file=sys.stderr)
    return 0


def check_prompt(text: str) -> None:
    """Refuse a prompt with nothing in it, or one that is not UTF-8 text (a file in another
    encoding, passed as "$(cat file)", reaches Python as undecodable bytes)."""
    if not text.strip():
        raise ForerunError("the prompt is empty: give the text to answer (or leave it out for the built-in one)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else repr(text[e.start])
        raise ForerunError(f"the prompt is not UTF-8 text ({what} at character {e.start}); convert it first, "
                           "e.g. iconv -f latin1 -t utf-8 FILE") from None


def _show_drafts(llm, out):
    from forerun.bench.provenance import Sample, render_terminal, token_pieces

    render_terminal(Sample("output", token_pieces(llm.decode, out.token_ids), out.stats.origins))


def _speedup_line(llm, prompt, params, out, label: str, repeats: int) -> str:
    """Plain vs speculative over `repeats` alternating pairs (the streamed run is the first
    speculative one): tok/s summed over the pairs, the per-pair range and a verdict."""
    from forerun.bench.spread import busy_note, verdict

    spec_runs, plain_runs = [out], []
    for i in range(repeats):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        for side in order:
            if side == "spec" and i == 0:
                continue  # the streamed run
            runs = plain_runs if side == "plain" else spec_runs
            runs.append(llm.generate(prompt, params, speculative=None if side == "plain" else llm.speculative)[0])
    ratios = sorted(p.stats.wall_time / q.stats.wall_time for p, q in zip(plain_runs, spec_runs))
    tok_s = lambda runs: sum(o.stats.generated for o in runs) / sum(o.stats.wall_time for o in runs)  # noqa: E731
    speedup = sum(o.stats.wall_time for o in plain_runs) / sum(o.stats.wall_time for o in spec_runs)
    s = out.stats
    line = (f"plain {tok_s(plain_runs):.1f} tok/s | speculative ({label}) {tok_s(spec_runs):.1f} tok/s | "
            f"speedup {speedup:.2f}x")
    if repeats > 1:
        line += f" (pairs {ratios[0]:.2f}-{ratios[-1]:.2f}x: {verdict(ratios[0], ratios[-1])})"
    line += f" | acceptance {s.acceptance_rate:.1%} | mean accepted length {s.mean_accepted_length:.2f}"
    if params.greedy:
        line += " | output " + ("identical" if all(o.token_ids == out.token_ids for o in plain_runs) else "differs")
    import torch

    busy = busy_note(torch.get_num_threads())
    return line + (f"\nforerun: warning: {busy}" if busy else "")


# Vicuna ids that duplicate Spec-Bench prompts (see the data's SOURCES.md): never tune on them.
SPEC_BENCH_OVERLAP = {"vicuna/64", "vicuna/67", "vicuna/77"}


def cmd_tune_skip(args) -> int:
    from tqdm import tqdm

    from forerun.bench.bench import prompt_ids
    from forerun.bench.tune_skip import confirm, search
    from forerun.config import SamplingParams
    from forerun.drafters.skip_profile import save_profile
    from forerun.llm import LLM
    from forerun.prompts import load_prompts

    if min(args.confirm, args.k, args.limit, args.max_new_tokens) < 1:
        raise ForerunError("--confirm, --k, --limit and --max-new-tokens must be >= 1")
    llm = LLM(model=args.model, dtype=args.dtype, speculative=None, enable_prefix_caching=False)
    prompts = [p for p in load_prompts(args.prompts, data_dir=args.data_dir) if p.id not in SPEC_BENCH_OVERLAP][: args.limit]
    ids = [prompt_ids(llm, p) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    calib = []
    for p in tqdm(ids, desc="calibration text (greedy)", file=sys.stderr):
        calib.append(p + llm.generate([p], greedy, speculative=None)[0].token_ids)
    n = llm.model.config.num_hidden_layers
    max_skip = args.max_skip or n // 2
    with tqdm(total=n + max_skip, desc="scoring skip sets", file=sys.stderr) as bar:
        cands = search(llm, calib, args.k, max_skip, progress=bar.update)
    print(f"forerun: timing the best {min(args.confirm, len(cands))} skip sets against plain decoding...", file=sys.stderr, flush=True)
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
    from forerun.bench.cost import plot
    from forerun.cost_curve import CostCurve, measure
    from forerun.bench.fidelity import line_for
    from forerun.llm import LLM

    tokens = sorted(set(int_list(args.tokens) or ()) | {1})
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if min(tokens) < 1 or args.context < 1 or args.repeats < 1 or not dtypes:
        raise ForerunError("--tokens, --context and --repeats must be >= 1, and --dtype must name a precision")
    for d in dtypes:
        if d not in DTYPES:
            raise ForerunError(f"--dtype: {d!r} is not a precision; choose from {', '.join(DTYPES)}{near_miss(d, DTYPES)}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    curves, fidelities = [], []
    for dtype in dtypes:
        llm = LLM(model=args.model, dtype=dtype, speculative=None)
        print(f"forerun: timing {llm.name} at {dtype} ({len(tokens)} sizes x {args.repeats} rounds)...", file=sys.stderr, flush=True)
        curves.append(CostCurve(llm.name, dtype, args.context, measure(llm.model, tokens, args.context, args.repeats)))
        fidelities.append(line_for(llm, args.model))
        del llm
    if args.plot:
        plot(curves, args.plot)
    if args.json:
        print(json.dumps([{"model": c.model, "dtype": c.dtype, "context": c.context, "ms": c.ms,
                           "ratio": {t: round(c.ratio(t), 3) for t in c.ms}, "fidelity": f}
                          for c, f in zip(curves, fidelities)], indent=2))
    else:
        print("tokens  " + "  ".join(f"{c.dtype:>16}" for c in curves))
        for t in tokens:
            print(f"{t:6d}  " + "  ".join(f"{c.ms[t]:8.1f} ms {c.ratio(t):4.2f}x" for c in curves))
        for f in fidelities:
            print(f)
    if args.plot:
        print(f"plot: {Path(args.plot).resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
