"""`forerun compare`: one method against plain decoding on one prompt set, printed as a short
report. It is a one-cell `forerun bench`: the set's first prompts are one workload, run by
grid.run_workload (plain and speculative alternating per prompt, after a warm-up) and
summed up by cell.summarize_cell (speedup with its 95% bootstrap interval over prompts,
acceptance, tau, decode-only tok/s, the drafter's cost). What a single comparison adds:
where greedy outputs part and the verifier's top-2 logit gap there (a near-tie that lower
precision can flip), and below float32 the top-1 agreement with float32 on a fixed text.
"""
from __future__ import annotations

import json
import sys

from forerun.bench.bench import prompt_ids
from forerun.bench.cell import PairRun, summarize_cell
from forerun.bench.grid import Workload, make_methods, refuse, run_workload, warm_up
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ForerunError
from forerun.llm import LLM

FIXED_TEXT = (
    "Speculative decoding lets a cheap drafter propose several tokens that the large model then checks "
    "in a single forward pass. def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
)


def cmd_compare(args) -> int:
    import torch

    from forerun.bench.spread import busy_note
    from forerun.cli_args import configs
    from forerun.prompts import load_prompts

    params, spec = configs(args)
    if not spec.enabled:
        raise ForerunError("compare needs a speculative method and --k >= 1")
    prompts = load_prompts(args.prompts, limit=args.limit, data_dir=args.data_dir)
    llm = LLM(model=args.model, dtype=args.dtype, speculative=None, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype)
    work = Workload(args.prompts, [(p.id, prompt_ids(llm, p)) for p in prompts])
    report = {"prompts": args.prompts, "dtype": llm.dtype, "max_new_tokens": params.max_tokens,
              "temperature": params.temperature, **run_compare(llm, work, params, spec)}
    report["warnings"] = [w for w in [busy_note(torch.get_num_threads())] if w]
    if llm.dtype != "float32":
        ref = LLM(model=args.model, dtype="float32", speculative=None, progress=False)
        report["top1_agreement_vs_float32"] = top1_agreement(llm.model, ref.model, llm.encode([FIXED_TEXT])[0])
    print(json.dumps(report, indent=2) if args.json else "\n".join(report_lines(report)))
    return 0


def run_compare(llm: LLM, work: Workload, params: SamplingParams, spec: SpeculativeConfig, progress: bool = True) -> dict:
    """The cell of `spec` against plain decoding on `work`, with `divergences` (greedy only)."""
    from tqdm import tqdm

    methods = make_methods(llm, [spec])
    refuse(warm_up(llm, methods, work.prompts[0][1]))
    m = methods[0]
    with tqdm(total=2 * len(work.prompts), desc="runs", unit="run", file=sys.stderr, disable=not progress) as bar:
        pairs = run_workload(llm, methods, work, params, tick=bar.update)[m.label]
    cell = summarize_cell(work.category, m.label, m.k, pairs, params.greedy)
    cell["divergences"] = divergences(llm, dict(work.prompts), pairs) if params.greedy else []
    return cell


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a shorter one differs where it ends).
    >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2, 3]), first_divergence([1], [1])
    (2, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergences(llm: LLM, ids: dict[str, list[int]], pairs: list[PairRun]) -> list[dict]:
    """Per prompt whose speculative output parts from the plain one inside the plain output:
    where, and the verifier's top-2 logit gap at that point."""
    out = []
    for p in pairs:
        pos = first_divergence(p.plain_tokens, p.spec_tokens)
        if pos is not None and pos < len(p.plain_tokens):
            gap = top2_gap(llm, ids[p.prompt_id], p.plain_tokens, pos)
            out.append({"id": p.prompt_id, "position": pos, "top2_logit_gap": gap})
    return out


def top2_gap(llm: LLM, ids: list[int], generated: list[int], pos: int) -> float:
    """Verifier's top-1 minus top-2 logit where the plain run chose generated[pos]:
    a small gap means a near-tie that lower precision can flip."""
    logits = llm.model.score(ids + generated[:pos], last_only=True)
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def top1_agreement(model_a, model_b, ids: list[int]) -> float:
    """Share of positions where two models' argmax agree on one fixed text (teacher forced)."""
    preds = [m.score(ids).argmax(-1) for m in (model_a, model_b)]
    return float((preds[0] == preds[1]).double().mean())


def report_lines(r: dict) -> list[str]:
    """The printed report (`--json` prints `r` itself)."""
    low, high = r["speedup_ci95"]
    cost = f"   drafter cost {r['draft_cost']:.2f} verifier forwards a step" if r.get("draft_cost") is not None else ""
    lines = [
        f"{r['prompts']}: {r['n_prompts']} prompts, {r['method']}, dtype {r['dtype']}, temperature {r['temperature']}",
        f"  plain        {r['plain_tokens_per_s']:7.2f} tok/s  (decode {r['plain_decode_tokens_per_s']:.2f})",
        f"  speculative  {r['tokens_per_s']:7.2f} tok/s  (decode {r['decode_tokens_per_s']:.2f})",
        f"  speedup {r['speedup']:.2f}x  (95% interval over prompts {low:.2f}-{high:.2f}x: {r['verdict']})",
        f"  acceptance {r['acceptance_rate']:.1%}   mean accepted length {r['tau']:.2f} "
        f"(predicted from acceptance {r['predicted_tau']:.2f}){cost}",
    ]
    if r["identical"] is not None:
        lines.append(f"  identical to plain: {r['identical']}  (match share {r['match_share']:.0%})")
    lines += [f"    {d['id']}: first differs at token {d['position']}, top-2 logit gap {d['top2_logit_gap']:.4f}"
              for d in r["divergences"]]
    lines += [f"  warning: {w}" for w in r.get("warnings", [])]
    if "top1_agreement_vs_float32" in r:
        lines.append(f"  top-1 agreement with float32 on a fixed text: {r['top1_agreement_vs_float32']:.1%}")
    return lines
