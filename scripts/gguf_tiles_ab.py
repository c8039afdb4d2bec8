"""The AVX2 Q4_K / Q6_K tiles that take both 8-row halves per broadcast (the default) against
the K-quant loop that takes one half at a time (`set_gguf_paired_halves(False)`), alternated
in one process on the same forwards, so the machine's drift hits both alike. With `--compare
tokens`: the paired tiles 16 tokens a pass (the default) against 8 (`set_gguf_paired_tokens(8)`),
on forwards of 1, 9, 12 and 16 tokens. With `--compare int4` (a model at int4, the 0.5B drafter's
groups of 64): int4_rows' 3-8 tokens both halves per pass (the default) against a half at a time
(`set_int4_paired(False)`), on forwards of 1, 3, 4 and 6 tokens.

    python scripts/gguf_tiles_ab.py --model qwen2.5-coder-1.5b --context 300,2000 --rounds 9
    python scripts/gguf_tiles_ab.py --compare tokens --context 300,2000 --rounds 9
    python scripts/gguf_tiles_ab.py --compare int4 --model qwen2.5-coder-0.5b --dtype int4 --rounds 9

Per context length: a 128-token prefill chunk after that many cached tokens, and verifier
forwards of 1, 4 and 9 tokens there (logits at every position), median seconds of each path
and their ratio; the logits of the two paths must be equal (same bits), or it stops. Needs the
kernels built for AVX2 without AVX512-VNNI (elsewhere the switch changes nothing). The prompt is
the Python standard library's difflib.py, tokenized.
"""
import argparse
import difflib
import inspect
import statistics
import time

import torch

from forerun.kernels import loader as kernel_loader
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from forerun.prefill import PrefixWrite, write_prefixes

STEPS = (1, 4, 9)
# --compare: the kernel's switch, its (before, after) settings with their names, the forwards timed
COMPARE = {
    "halves": ("set_gguf_paired_halves", ((False, True), ("one half at a time", "paired")), STEPS),
    "tokens": ("set_gguf_paired_tokens", ((8, 16), ("8 a pass", "16 a pass")), (1, 9, 12, 16)),
    "int4": ("set_int4_paired", ((False, True), ("a half at a time", "paired")), (1, 3, 4, 6)),
}
CHUNK = 128


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--context", default="300,2000", help="cached tokens before the timed forwards, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compare", choices=list(COMPARE), default="halves",
                    help="halves: paired tiles against one half at a time; tokens: 16 tokens a pass against 8; "
                    "int4: int4_rows' paired passes for 3-8 tokens against a half at a time")
    args = ap.parse_args()
    kernel = kernel_loader.load()
    switch, settings, steps = COMPARE[args.compare]
    if kernel is None or not hasattr(kernel, switch):
        raise SystemExit(f"these kernels have no {switch} switch (FORERUN_NO_KERNELS, or an older build)")
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    model = llm.model
    contexts = [int(c) for c in args.context.split(",")]
    ids = []
    while len(ids) < max(contexts) + CHUNK:
        ids += llm.encode([inspect.getsource(difflib)])[0]
    for ctx in contexts:
        times: dict[tuple[str, bool], list[float]] = {}
        with torch.inference_mode():
            cache = model.new_cache(1, ctx + CHUNK + 1)
            write_prefixes(model, cache, [PrefixWrite(0, 0, ids[:ctx])])
            for _ in range(args.rounds):
                logits = {}
                for setting in settings[0]:
                    getattr(kernel, switch)(setting)
                    dt, _ = timed(lambda: write_prefixes(model, cache, [PrefixWrite(0, ctx, ids[ctx:ctx + CHUNK])]))
                    times.setdefault((f"prefill {CHUNK}", setting), []).append(dt)
                    for n in steps:
                        batch = chain_batch([ids[ctx:ctx + n]], [ctx], [0], model.device)
                        dt, out = timed(lambda: model(batch, cache, logits_at="all"))
                        times.setdefault((f"forward of {n}", setting), []).append(dt)
                        logits[(n, setting)] = out.logits
                for n in steps:
                    if not torch.equal(logits[(n, settings[0][0])], logits[(n, settings[0][1])]):
                        raise SystemExit(f"the two paths' logits differ (forward of {n} at {ctx} cached tokens)")
        getattr(kernel, switch)(settings[0][1])
        for what in [f"prefill {CHUNK}"] + [f"forward of {n}" for n in steps]:
            before, after = (statistics.median(times[(what, v)]) for v in settings[0])
            print(f"{ctx} cached, {what}: {settings[1][0]} {before * 1e3:.0f} ms, {settings[1][1]} {after * 1e3:.0f} ms, "
                  f"{before / after:.3f}x", flush=True)
    print("logits equal on both paths: yes")


if __name__ == "__main__":
    main()
