"""forerun's speculative decoding against llama.cpp's plain decoding, interleaved round by round.

    PYTHONPATH=. python scripts/llama_rounds.py --llama-cpp-dir <llama.cpp build/bin> \
        --gguf ~/.cache/forerun/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --rounds 5

`forerun bench --vs llama.cpp` runs one engine after the other; on a machine whose memory speed
drifts within minutes that ratio moves by 20%. Here every round runs each forerun configuration on
the same prompts (greedy, decode-only tok/s) with `llama-bench -p 0 -n N -t T -d D` before the
first, between each two and after the last, and a configuration's ratio is over the mean of the
llama.cpp runs just before and after it. D (--depth) is the context llama.cpp decodes after: by
default the prompts' mean length, as forerun decodes after each prompt (each token's attention
reads the whole context, so llama.cpp at no context would decode long prompts faster than it can).
Configurations: `--config DTYPE:K[:LOOKUP[:DRAFT_DTYPE]]` (the verifier's dtype, k, optionally
--draft-lookup's N and the drafter's precision), the drafter given by --draft-model / --draft-dtype
(its default precision) / --draft-vocab.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forerun import LLM, SamplingParams  # noqa: E402
from forerun.bench.peers import llama_bench_cmd, mean_depth  # noqa: E402
from forerun.config import SpeculativeConfig  # noqa: E402
from forerun.metrics import merge  # noqa: E402
from forerun.prompts import load_prompts  # noqa: E402


def llama_bench(bin_dir: Path, gguf: str, tokens: int, threads: int, depth: int) -> float:
    """llama.cpp's plain decode rate (tok/s) for `tokens` new tokens after `depth` of context, one repetition."""
    cmd = llama_bench_cmd(bin_dir, gguf, tokens, threads, depth, repetitions=1)
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)[0]["avg_ts"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-dir", required=True, type=Path, help="folder with llama-bench")
    ap.add_argument("--gguf", required=True, help="the verifier's GGUF, as llama.cpp reads it")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft-dtype", default="int4")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--config", action="append", default=None, help="DTYPE:K[:LOOKUP[:DRAFT_DTYPE]], repeatable, K a number or auto (default int8:6 and int4:4:1; the "
                    "drafter's precision defaults to --draft-dtype)")
    ap.add_argument("--prompts", default="humaneval", help="a prompt set, or several comma-separated")
    ap.add_argument("--limit", type=int, default=2, help="prompts taken from each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", default="auto", help="tokens of context llama-bench decodes after (its -d): a number, "
                    "or auto, the prompts' mean length (forerun decodes after each prompt; 0 was the rule before 2026-12-05)")
    args = ap.parse_args()
    if args.depth != "auto" and not args.depth.isdigit():
        raise SystemExit(f"--depth: a number of tokens or auto, got {args.depth!r}")
    torch.set_num_threads(args.threads)
    configs = {}
    drafts = {}  # one drafter per precision, shared by the configs
    for item in args.config or ["int8:6", "int4:4:1"]:
        parts = item.split(":")
        dtype, k = parts[:2]
        lookup = parts[2] if len(parts) > 2 else "0"
        draft_dtype = parts[3] if len(parts) > 3 else args.draft_dtype
        if draft_dtype not in drafts:
            drafts[draft_dtype] = LLM(model=args.draft_model, dtype=draft_dtype, progress=False, enable_prefix_caching=False)
        llm = LLM(model=args.model, dtype=dtype, progress=False, enable_prefix_caching=False)  # each config its own (an LLM keeps one drafter)
        options = {"draft_vocab": args.draft_vocab, **({"draft_lookup": int(lookup)} if int(lookup) else {})}
        spec = SpeculativeConfig(method="draft_model", draft_model=drafts[draft_dtype],
                                 num_speculative_tokens=k if k == "auto" else int(k), options=options)
        name = f"forerun {dtype} verifier, draft_model k={k}" + (f", lookup {lookup}" if int(lookup) else "") + \
            (f", {draft_dtype} drafter" if k != "0" else "")
        configs[name] = (llm, spec)
    prompts = [p for spec in args.prompts.split(",") for p in load_prompts(spec, limit=args.limit)]
    first = next(iter(configs.values()))[0]  # one tokenizer: the configurations share the model
    texts = [first.apply_chat_template([{"role": "user", "content": p.text}]) if p.chat else p.text for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    depth = mean_depth(first.encode(texts)) if args.depth == "auto" else int(args.depth)
    print(f"{len(texts)} prompts; llama-bench decodes after {depth} tokens of context (-d)", flush=True)
    for llm, spec in configs.values():  # warm-up: kernels, caches, the drafter's first load
        llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=16), speculative=spec)
    # llama.cpp runs before the first configuration, between each two and after the last: each
    # configuration's ratio is over the mean of the llama.cpp runs just before and after it, so
    # the machine's drift over a round (minutes) falls on both sides of the ratio alike.
    rates: dict[str, list[float]] = {"llama.cpp plain": []}
    ratios: dict[str, list[float]] = {}
    end_to_end: dict[str, list[float]] = {}  # forerun's tok/s with the prompt's prefill counted

    def bench() -> float:
        return llama_bench(args.llama_cpp_dir, args.gguf, args.max_new_tokens, args.threads, depth)

    for r in range(args.rounds):
        before = bench()
        llama = [before]
        for name, (llm, spec) in configs.items():
            outs = [llm.generate([t], params, speculative=spec)[0] for t in texts]
            stats = merge([o.stats for o in outs])
            after = bench()
            llama.append(after)
            rates.setdefault(name, []).append(stats.decode_tokens_per_s)
            end_to_end.setdefault(name, []).append(stats.tokens_per_s)
            ratios.setdefault(name, []).append(stats.decode_tokens_per_s / ((before + after) / 2))
            before = after
        rates["llama.cpp plain"].append(statistics.mean(llama))
        print(f"round {r + 1}: llama.cpp plain {' / '.join(f'{x:.1f}' for x in llama)}, "
              + ", ".join(f"{k} {v[-1]:.1f} ({ratios[k][-1]:.2f}x)" for k, v in rates.items() if k in ratios), flush=True)
    for name, v in rates.items():
        e2e = f"; end to end {' '.join(f'{x:.1f}' for x in end_to_end[name])}" if name in end_to_end else ""
        over = (f"; over llama.cpp's decode just before and after it: {' '.join(f'{x:.2f}' for x in ratios[name])} "
                f"(median {statistics.median(ratios[name]):.2f}x)") if name in ratios else " (mean of each round's runs)"
        print(f"{name}: decode tok/s {' '.join(f'{x:.1f}' for x in v)}{e2e}{over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
