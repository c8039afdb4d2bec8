"""The CLI side of `forerun bench`, `forerun advise`, `forerun drift` and `forerun quality`
(parsers and commands; forerun/cli.py registers them). Imports stay inside the commands so that
`forerun --help` does not load torch."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from forerun.cli_args import KV_CACHE_DTYPES, KV_CACHE_HELP, configs, int_list, k_arg
from forerun.errors import ForerunError

BENCH_SETS = "spec_bench:summarization,spec_bench:qa,humaneval"


def register(sub, kit) -> None:
    """bench, advise, drift and quality (cli_args.CommandKit: the shared options, the runs folder)."""
    fmt, common, runs_dir = kit.fmt, kit.add_common, kit.runs_dir
    b = sub.add_parser("bench", formatter_class=fmt, conflict_handler="resolve",
                       help="plain vs methods x k on prompt sets: JSON, Markdown/HTML report, plots, a verdict")
    common(b)
    b.add_argument("--prompts", default=BENCH_SETS, help="comma-separated prompt sets (each spec_bench:<subtask> is "
                   "one workload; other sets split by category) or .jsonl files")
    b.add_argument("--data-dir", default=None, help="prompt data folder (default: $FORERUN_DATA_DIR or ../shared/data/prompts)")
    b.add_argument("--limit", type=int, default=3, help="prompts per workload")
    b.add_argument("--turns", type=int, default=1, help="play up to N user turns of multi-turn prompts (Spec-Bench's "
                   "MT-Bench, Vicuna, JSONL rows with turns) as sessions: each turn resends the history with plain "
                   "decoding's answers")
    b.add_argument("--method", "--methods", dest="methods", default="ngram", help="comma-separated drafters")
    b.add_argument("--k", default="5", help="comma-separated draft lengths, 'auto' included (e.g. 3,5,auto)")
    b.add_argument("--draft-model", default=None, help="comma-separated draft models for draft_model (same forms as "
                   "--model; another tokenizer is bridged; the first is transformers' assistant) or head folders "
                   "for medusa / eagle / dflash (each used by the method it was trained for): one cell each")
    b.add_argument("--ngram-branches", default="1", help="ngram: comma-separated tree widths (1 = chain), one cell each")
    b.add_argument("--out", default=f"{runs_dir}/bench", help="report folder (bench.json, report.md/.html, PNGs)")
    b.add_argument("--resume", action="store_true", help="keep the cells already in OUT/bench.json, run the rest")
    b.add_argument("--no-cost", action="store_true", help="skip the cost curve behind the batch-size estimates")
    b.add_argument("--vs", default="", help="peers to run beside forerun: transformers, llama.cpp (comma-separated)")
    b.add_argument("--peer-limit", type=int, default=2, help="prompts (from the first workload) the peers run")
    b.add_argument("--exit-layer", type=int, default=None, help="early_exit, and transformers' assistant_early_exit: "
                   "draft with the first N layers (default: half)")
    b.add_argument("--llama-cpp-dir", default=None, help="folder with llama-bench (default: $FORERUN_LLAMA_CPP_BIN)")
    b.add_argument("--draft-gguf", default=None, help="draft GGUF for llama.cpp's draft-model speculation")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(handler=cmd_bench)
    a = sub.add_parser("advise", formatter_class=fmt, help="verdicts per workload from a bench JSON")
    a.add_argument("report", help="a bench.json written by forerun bench")
    a.set_defaults(handler=cmd_advise)
    d = sub.add_parser("drift", formatter_class=fmt, conflict_handler="resolve",
                       help="does a drafter still pay after the verifier changed? old vs new verifier, same prompts")
    common(d)
    d.add_argument("--method", "--methods", "--drafter", dest="methods", default="ngram", help="comma-separated drafters")
    d.add_argument("--old-model", default=None, help="the verifier the drafter was set up for (default: embedded)")
    d.add_argument("--new-model", default=None, help="the new verifier version (default: the old one)")
    d.add_argument("--old-dtype", default=None, help="old verifier precision (default: --dtype)")
    d.add_argument("--new-dtype", default=None, help="new verifier precision (default: --dtype)")
    d.add_argument("--perturb", type=float, default=0.0, help="add noise of this x each weight's std to the new verifier (a stand-in for a fine-tune)")
    d.add_argument("--prompts", default="spec_bench:summarization,spec_bench:qa", help="comma-separated prompt sets")
    d.add_argument("--data-dir", default=None, help="prompt data folder")
    d.add_argument("--limit", type=int, default=3, help="prompts per workload")
    d.add_argument("--out", default=None, help="write the comparison as JSON here")
    d.set_defaults(handler=cmd_drift)
    q = sub.add_parser("quality", formatter_class=fmt,
                       help="fidelity per precision: perplexity, KL and top-1 agreement vs float32 on a text")
    q.add_argument("--model", default=None, help="model folder, .gguf file, hub id, or embedded name (default: smollm2-135m)")
    q.add_argument("--dtype", default="float32,int8", help="comma-separated precisions (float32, the reference, always runs first)")
    q.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="a UTF-8 text file to score (repeatable: concatenated); default: the Python sources of "
                        "argparse, difflib and textwrap from this interpreter")
    q.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help=f"for the precisions measured (the float32 reference keeps a float32 cache): {KV_CACHE_HELP}; "
                        "float16 rows are labelled '<dtype> kv=float16', float32 among them")
    q.add_argument("--ctx", type=int, default=512, help="tokens per chunk (the second half of each is scored)")
    q.add_argument("--chunks", type=int, default=6, help="chunks scored (at most the text's tokens // --ctx)")
    q.add_argument("--llama-cpp-dir", default=None,
                   help="folder with llama-perplexity: add its estimate on the model's GGUF as a row")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(handler=cmd_quality)


def _ks(text: str) -> list:
    ks = [k_arg(x.strip()) for x in text.split(",") if x.strip()]
    if not ks or any(k == 0 for k in ks):
        raise ForerunError("--k needs draft lengths >= 1 or 'auto' (plain decoding always runs)")
    return ks


def specs_from(args) -> list:
    """One SpeculativeConfig per method x k x the method's own listed options (draft
    models, n-gram tree widths), with the shared drafter options from args."""
    specs = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if method in ("plain", "none"):
            raise ForerunError("plain decoding always runs: list only drafters in --methods")
        for k in _ks(str(args.k)):
            specs += [configs(_one(args, method, k, **extra))[1] for extra in _variants(method, args)]
    return specs


# Drafters that never read --draft-model: their cells get none, whatever the grid lists.
SELF_DRAFTERS = {"ngram", "layer_skip", "early_exit", "quantized", "lookahead"}


def _variants(method: str, args) -> list[dict]:
    """The grid's axis inside one method: each listed draft model (or head folder) of a
    method that reads one, each tree width of the n-gram drafter (both comma-separated on
    the command line)."""
    if method == "ngram":
        return [{"ngram_branches": b} for b in int_list(str(args.ngram_branches)) or (1,)]
    if method == "suffix":  # alone, then a hybrid with each listed draft model
        return [{}] + [{"draft_model": d.strip()} for d in (args.draft_model or "").split(",") if d.strip()]
    if method not in SELF_DRAFTERS and args.draft_model:
        listed = [d.strip() for d in args.draft_model.split(",") if d.strip()]
        if method in HEAD_METHODS:  # head folders: each goes to the method it was trained for
            listed = _heads_for(method, listed)
        else:  # a draft model, not a head folder
            listed = [d for d in listed if not _is_head(d)]
        return [{"draft_model": d} for d in listed]
    return [{}]


HEAD_METHODS = {"medusa", "eagle", "dflash"}


def _is_head(entry: str) -> bool:
    from pathlib import Path

    from forerun.heads.checkpoint import CARD

    return (Path(entry) / CARD).is_file()


def _heads_for(method: str, folders: list[str]) -> list[str]:
    """The --draft-model entries that are `method` heads (head.json says so), so that
    `--methods eagle,dflash --draft-model E,D` pairs each head with its own method."""
    from forerun.errors import ConfigError
    from forerun.heads.checkpoint import read_card

    mine = [f for f in folders if _is_head(f) and read_card(f)["method"] == method]
    if not mine:
        raise ConfigError(f"--methods {method}: none of --draft-model {','.join(folders)} is a {method} head folder "
                          f"(train one with `forerun train --method {method}`)")
    return mine


def cmd_bench(args) -> int:
    import torch

    from forerun.bench.bench import BenchRun, run_bench, save, workloads_from
    from forerun.bench.fidelity import line_for
    from forerun.bench.grid import make_methods
    from forerun.bench.report import screenshot, write_reports
    from forerun.bench.spread import busy_note
    from forerun.llm import LLM

    params, _ = configs(_plain(args))
    specs = specs_from(args)
    verifier = LLM(model=args.model, dtype=args.dtype, speculative=None, enable_prefix_caching=False,
                   kv_cache_dtype=args.kv_cache_dtype)
    sets = [s.strip() for s in args.prompts.split(",") if s.strip()]
    workloads = workloads_from(verifier, sets, args.limit, args.data_dir, turns=args.turns)
    if args.vs:
        _exit_layer(args, verifier)  # a bad --exit-layer fails now, not after the run
    meta = {"model": args.model or "smollm2-135m", "dtype": args.dtype, "prompts": args.prompts, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "threads": torch.get_num_threads(),
            **({"turns": args.turns} if args.turns > 1 else {})}
    run = BenchRun(verifier, make_methods(verifier, specs), workloads, params, meta, Path(args.out), args.resume,
                   progress=not args.no_progress)
    result = run_bench(run)
    result["fidelity"] = line_for(verifier, args.model)  # (not in meta: a record made between runs must not stop --resume)
    run.out.mkdir(parents=True, exist_ok=True)
    if not args.no_cost and "cost_curve" not in result:
        result["cost_curve"] = _cost_curve(verifier)
    if args.vs:
        ran = {c["method"] for c in result["cells"]}
        result["peers"] = _peers(args, verifier, workloads, specs, [m for m in run.methods if m.label in ran])
    busy = busy_note(torch.get_num_threads())
    if busy and busy not in result["warnings"]:
        result["warnings"].append(busy)
    written = write_reports(result, run.out)
    save(result, run.json_path)
    shot = screenshot(written["report.html"], run.out / "report-screenshot.png")
    for warning in result["warnings"]:  # (report.md lists them last, after the results this does not print)
        print(f"forerun: warning: {warning}", file=sys.stderr, flush=True)
    print((run.out / "report.md").read_text().split("## Results")[0])
    print(f"wrote {', '.join(str(p) for p in [run.json_path, *written.values()])}"
          + (f", {shot}" if shot else " (no chromium: no screenshot)"), file=sys.stderr)
    return 0


def _plain(args):
    return _one(args, "none", 0)


def _one(args, method: str, k, **extra):
    """args for one cell: `method`, `k`, and `extra` over the bench's lists (draft models,
    tree widths), which default to none and a chain."""
    ns = copy.copy(args)
    ns.method, ns.k, ns.ngram_branches, ns.draft_model = method, k, 1, None
    vars(ns).update(extra)
    return ns


def _cost_curve(verifier) -> dict:
    from forerun.cost_curve import measure

    print("forerun: measuring the verifier's cost curve (forward time vs tokens scored)...", file=sys.stderr, flush=True)
    tokens = [1, 2, 4, 8, 16, 32, 64]
    return {"context": 256, "ms": {str(t): ms for t, ms in measure(verifier.model, tokens, 256, 3).items()}}


def _peers(args, verifier, workloads, specs, methods) -> dict:
    from forerun.bench.peers import PeerSetup, run_peers
    from forerun.llm import LLM

    prompts = workloads[0].prompts[: args.peer_limit]
    texts = [verifier.decode(ids) if verifier.tokenizer is not None else "" for _, ids in prompts]
    ks = [s.num_speculative_tokens for s in specs if isinstance(s.num_speculative_tokens, int)]
    first_draft = next((s.draft_model for s in specs if s.method == "draft_model" and s.draft_model), None)
    draft_src = LLM(first_draft, dtype="float32", progress=False).source if first_draft else None
    setup = PeerSetup([ids for _, ids in prompts], texts, args.max_new_tokens, ks[0] if ks else 5, draft_src,
                      gguf_for(args.model), Path(args.draft_gguf) if args.draft_gguf else None, args.llama_cpp_dir,
                      exit_layer=_exit_layer(args, verifier))
    vs = [v.strip() for v in args.vs.split(",") if v.strip()]
    print(f"forerun: peers ({', '.join(vs)}) on {len(prompts)} prompts...", file=sys.stderr, flush=True)
    return run_peers(verifier, vs, setup, methods)


def _exit_layer(args, verifier) -> int:
    """transformers' assistant_early_exit: --exit-layer, else half the verifier's layers."""
    layers = verifier.model.config.num_hidden_layers
    n = args.exit_layer or max(1, layers // 2)
    if not 1 <= n < layers:
        raise ForerunError(f"--exit-layer {n}: the verifier has {layers} layers (draft with 1 to {layers - 1})")
    return n


def gguf_for(model: str | None) -> Path | None:
    """The GGUF behind an embedded model name or a .gguf path; None for other forms."""
    from forerun import embedded

    if model is None or model in ("default", "smollm2-135m"):
        return embedded.ensure_default_gguf(progress=False)
    if model in embedded.QWEN_MODELS:
        return embedded.ensure_chunked_gguf(embedded.QWEN_MODELS[model], progress=False)
    if model == "gemma3-270m":
        return embedded.gemma3_gguf_path()
    return Path(model) if model.endswith(".gguf") else None


def cmd_advise(args) -> int:
    from forerun.bench.advise import advise, summary_line

    path = Path(args.report)
    if not path.is_file():
        raise ForerunError(f"no bench report at {path} (run forerun bench --out FOLDER first)")
    adv = advise(json.loads(path.read_text()))
    print(summary_line(adv))
    for a in adv:
        print(a.text())
    return 0


def cmd_drift(args) -> int:
    from forerun.bench.drift import compare, report_lines

    specs = specs_from(args)
    old_dtype, new_dtype = args.old_dtype or args.dtype, args.new_dtype or args.dtype
    cells = {}
    for side, model, dtype, sigma in (("old", args.old_model, old_dtype, 0.0), ("new", args.new_model or args.old_model, new_dtype, args.perturb)):
        print(f"forerun: {side} verifier: {model or 'smollm2-135m'} at {dtype}" + (f", perturbed x{sigma}" if sigma else ""),
              file=sys.stderr, flush=True)
        cells[side] = _side_cells(args, model, dtype, sigma, specs)
    flags = compare(cells["old"], cells["new"])
    for line in report_lines(flags):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"old": cells["old"], "new": cells["new"], "flags": [f.to_dict() for f in flags]}, indent=1))
    return 1 if any(f.status == "stopped paying" for f in flags) else 0


def _side_cells(args, model, dtype: str, sigma: float, specs) -> list[dict]:
    from forerun.bench.bench import workloads_from
    from forerun.bench.cell import summarize_cell
    from tqdm import tqdm

    from forerun.bench.grid import make_methods, refuse, run_workload, warm_up
    from forerun.bench.drift import perturb_
    from forerun.llm import LLM

    params, _ = configs(_plain(args))
    verifier = LLM(model=model, dtype=dtype, speculative=None, progress=False, enable_prefix_caching=False,
                   kv_cache_dtype=args.kv_cache_dtype)
    if sigma:
        try:
            perturb_(verifier.model, sigma, seed=args.seed)
        except ValueError as e:
            raise ForerunError(f"--perturb: {e}") from None
    methods = make_methods(verifier, specs)
    workloads = workloads_from(verifier, [s.strip() for s in args.prompts.split(",") if s.strip()], args.limit, args.data_dir)
    refuse(warm_up(verifier, methods, workloads[0].prompts[0][1]))
    cells = []
    runs = sum(len(w.prompts) for w in workloads) * (len(methods) + 1)  # plain + each method, per prompt
    with tqdm(total=runs, desc=f"{model or 'smollm2-135m'} runs", unit="run", file=sys.stderr) as bar:
        for w in workloads:
            pairs = run_workload(verifier, methods, w, params, tick=bar.update)
            cells += [summarize_cell(w.category, m.label, m.k, pairs[m.label], params.greedy) for m in methods]
    return cells


def cmd_quality(args) -> int:
    from dataclasses import asdict
    from functools import partial

    import torch
    from tqdm import tqdm

    from forerun.bench import fidelity
    from forerun.bench.quality import QualityRow, evaluate, llama_perplexity, make_chunks, markdown_table, scored_span
    from forerun.llm import LLM
    from forerun.models.loader import load_model, resolve_dtype, resolve_precision

    kv = args.kv_cache_dtype
    _quality_dtypes(args.dtype, kv_cache=kv)  # a bad name fails before any model loads
    if args.ctx < 4 or args.chunks < 1:
        raise ForerunError("--ctx must be >= 4 and --chunks >= 1")
    text, sources = _quality_text(args.text)
    llama = _llama_run(args.llama_cpp_dir, args.model, torch.get_num_threads()) if args.llama_cpp_dir else None
    ref = LLM(model=args.model, dtype="float32")
    from forerun.linears.f32 import to_plain_linears_

    to_plain_linears_(ref.model)  # the reference scores hundreds of tokens a forward: torch's sgemm
    if args.ctx > ref.max_context:
        raise ForerunError(f"--ctx {args.ctx}: the model's context is {ref.max_context} tokens")
    lead = ref.tokenizer.encode("")  # [BOS] when the tokenizer adds one (llama.cpp's add_bos), else []
    bos = lead[0] if lead else None
    ids = ref.tokenizer.encode(text)
    if len(ids) < 2 * args.ctx:  # llama-perplexity's own floor: both score the same chunks
        raise ForerunError(f"the text is {len(ids)} tokens; --ctx {args.ctx} needs at least {2 * args.ctx}")
    chunks = make_chunks(ids, args.ctx, args.chunks, bos)
    dtypes = _quality_dtypes(args.dtype, lambda d: resolve_dtype(d, ref.source), kv)
    precisions = {fidelity.label_of(d, kv): resolve_precision(d, ref.source, kv_cache=kv) for d in dtypes}  # (checked now)
    models = {"float32": ref.model, **{label: partial(load_model, ref.source, p) for label, p in precisions.items()}}  # loaded in turn
    print(f"forerun: {ref.name}: {len(chunks)} chunks of {args.ctx} tokens ({len(scored_span(args.ctx))} scored "
          f"a chunk) from {', '.join(Path(s).name for s in sources)}", file=sys.stderr, flush=True)
    with tqdm(total=len(chunks) * len(models), desc="chunk x precision", file=sys.stderr) as bar:
        rows = evaluate(models, chunks, progress=bar.update)
    if llama is not None:
        ppl, tokens = llama_perplexity(llama, text, args.ctx, args.chunks)
        rows.append(QualityRow(f"llama.cpp ({llama.gguf.name})", ppl, tokens, (ppl / rows[0].ppl - 1) * 100))
    kept = fidelity.save(ref.source, ref.name, rows, ", ".join(Path(s).stem for s in sources), args.ctx, len(chunks))
    if kept is not None:
        print(f"forerun: recorded in {kept}: `forerun generate`, `cost`, `bench`, `eval` and `serve` print it "
              "beside their speeds", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": ref.name, "text": sources, "text_tokens": len(ids), "bos": bos is not None,
                          "ctx": args.ctx, "chunks": len(chunks), "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(markdown_table(rows))
    return 0


def _quality_dtypes(text: str, resolve=lambda dtype: dtype, kv_cache: str = "auto") -> list[str]:
    """The precisions measured against float32 (always the reference, on a float32 cache), in
    order, each once, after resolve() (the loader's resolve_dtype turns "auto" into what it
    loads: gguf or float32); float32 itself only with a float16 cache (another fidelity)."""
    from forerun.config import check_dtype

    listed = [resolve(check_dtype(d.strip())) for d in text.split(",") if d.strip()]
    return [d for i, d in enumerate(listed) if (d != "float32" or kv_cache == "float16") and d not in listed[:i]]


def _quality_text(files: list[str] | None) -> tuple[str, list[str]]:
    """(the text, where it came from): the --text files concatenated, else the default sources."""
    from forerun.bench.quality import default_text

    if not files:
        return default_text()
    texts = []
    for f in files:
        try:
            texts.append(Path(f).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ForerunError(f"--text {f}: {e}") from None
    return "\n".join(texts), list(files)


def _llama_run(bindir: str, model: str | None, threads: int):
    """llama-perplexity's folder and the model's GGUF, checked before any scoring starts."""
    from forerun.bench.quality import LlamaRun

    if not (Path(bindir) / "llama-perplexity").is_file():
        raise ForerunError(f"--llama-cpp-dir {bindir}: no llama-perplexity there")
    gguf = gguf_for(model)
    if gguf is None or not gguf.is_file():
        raise ForerunError(f"--llama-cpp-dir: no GGUF file for {model!r} (use an embedded model or a .gguf --model)")
    return LlamaRun(Path(bindir), gguf, threads)
