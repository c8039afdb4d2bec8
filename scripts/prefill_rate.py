"""Prefill speed of one prompt, per-query attention (batch-invariant with decoding: the
default) against SDPA's flash kernel for prompt rows (`CpuKernels.prefill_sdpa`), alternated
in one process so the machine's drift hits both alike.

    python scripts/prefill_rate.py --model qwen2.5-coder-1.5b --dtype gguf --tokens 512,2048 --rounds 3

Prints, per length, the median seconds and tok/s of each path and their ratio. The prompt is
text of the Python standard library (difflib.py, repeated as needed), tokenized. With --budgets
(e.g. 128,4096) it compares instead the forward sizes the prefill is cut into (prefill.write_prefixes'
budget), the per-query path throughout.
"""
import argparse
import dataclasses
import difflib
import statistics
import time
from pathlib import Path

import torch

from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from forerun.prefill import PrefixWrite, write_prefixes


def prefill_seconds(model, ids: list[int]) -> float:
    cache = model.new_cache(1, len(ids) + 1)
    start = time.perf_counter()
    with torch.inference_mode():
        model(chain_batch([ids], [0], [0], model.device), cache, logits_at=None)
    return time.perf_counter() - start


def budget_seconds(model, ids: list[int], budget: int) -> float:
    cache = model.new_cache(1, len(ids) + 1)
    start = time.perf_counter()
    with torch.inference_mode():
        write_prefixes(model, cache, [PrefixWrite(0, 0, ids)], budget=budget)
    return time.perf_counter() - start


def compare_budgets(model, ids: list[int], lengths: list[int], budgets: list[int], rounds: int) -> None:
    for n in lengths:
        times = {b: [] for b in budgets}
        for r in range(rounds):
            for b in budgets[:: 1 if r % 2 == 0 else -1]:
                times[b].append(budget_seconds(model, ids[:n], b))
        line = " | ".join(f"forwards of {b}: {statistics.median(t):7.2f} s ({n / statistics.median(t):6.1f} tok/s)"
                          for b, t in times.items())
        print(f"{n:6d} tokens: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", default=None, help="comma-separated forward sizes to compare instead")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, progress=False)
    model = llm.model
    text = Path(difflib.__file__).read_text()
    ids = llm.tokenizer.encode(text * 8)
    per_query = model.backend
    if not hasattr(per_query, "prefill_sdpa"):
        raise SystemExit(f"{args.model} at {args.dtype} does not run on forerun's kernels: nothing to compare")
    sdpa = dataclasses.replace(per_query, prefill_sdpa=True)
    print(f"{args.model} at {args.dtype}, {torch.get_num_threads()} threads")
    if args.budgets:
        return compare_budgets(model, ids, [int(t) for t in args.tokens.split(",")],
                               [int(b) for b in args.budgets.split(",")], args.rounds)
    for n in [int(t) for t in args.tokens.split(",")]:
        prompt = ids[:n]
        times = {"per-query": [], "sdpa": []}
        prefill_seconds(model, prompt[:64])  # warm up
        for r in range(args.rounds):
            for name, backend in (("per-query", per_query), ("sdpa", sdpa))[:: 1 if r % 2 == 0 else -1]:
                model.set_backend(backend)
                times[name].append(prefill_seconds(model, prompt))
        model.set_backend(per_query)
        pq, sd = statistics.median(times["per-query"]), statistics.median(times["sdpa"])
        print(f"{n:6d} tokens: per-query {pq:7.2f} s ({n / pq:6.1f} tok/s) | sdpa {sd:7.2f} s ({n / sd:6.1f} tok/s)"
              f" | per-query / sdpa {pq / sd:.3f}")


if __name__ == "__main__":
    main()
