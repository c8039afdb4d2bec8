"""Speculative configurations on the same prompts, alternated prompt by prompt in one process.

    PYTHONPATH=. python scripts/spec_ab.py --limit 3 '{"k": 0}' '{"k": "auto"}' '{"k": "auto", "method": "suffix"}'

Each argument is one configuration as JSON: "k" (a number, "auto", or 0 for plain decoding),
"method" (default draft_model; suffix with the draft model is the hybrid), "draft_model": false
for a method without one (suffix alone), "int4_paired": false to send int4's 3-8 token tiles a
half at a time (kernels' set_int4_paired, AVX2 builds), and any other key as a
SpeculativeConfig option (draft_p_min, suffix_min_score, ...). The draft model is the 0.5B at
int4 over 32768 ids with prompt lookup's guess checked (--draft-lookup 1), as `forerun` names
it by default. On this host the speed of the 2 vCPUs drifts from minute to minute, so each
prompt runs every configuration back to back (forward, then reversed order on the next prompt)
and the totals are compared; every configuration's output must equal the first one's (greedy).
Prints per configuration: decode tok/s, tau, drafted tokens and milliseconds of verification
and drafting a step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forerun import LLM, SamplingParams  # noqa: E402
from forerun.config import SpeculativeConfig  # noqa: E402
from forerun.kernels import loader as kernel_loader  # noqa: E402
from forerun.metrics import merge  # noqa: E402
from forerun.prompts import load_prompts  # noqa: E402

SPEC_BENCH = ",".join(f"spec_bench:{t}" for t in ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"))
DRAFTER_OPTIONS = {"draft_vocab": 32768, "draft_lookup": 1}


def config(text: str, drafter: LLM) -> tuple[SpeculativeConfig | None, bool]:
    """(the SpeculativeConfig, or None for plain decoding; whether int4's paired tiles run)."""
    c = json.loads(text)
    k, paired = c.pop("k", "auto"), c.pop("int4_paired", True)
    method, draft = c.pop("method", "draft_model"), drafter if c.pop("draft_model", True) else None
    if k == 0:
        return None, paired
    options = {**(DRAFTER_OPTIONS if draft is not None else {}), **c}
    return SpeculativeConfig(method=method, draft_model=draft, num_speculative_tokens=k, options=options), paired


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="one JSON object per configuration (see above)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default=SPEC_BENCH, help="prompt sets, comma-separated (default: Spec-Bench's six subtasks)")
    ap.add_argument("--limit", type=int, default=3, help="prompts taken from each set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernel_loader.load()
    set_paired = getattr(kernel, "set_int4_paired", None)  # None: no kernels, or a build without the switch
    llm = LLM(model=args.model, dtype=args.dtype, progress=False, enable_prefix_caching=False)
    drafter = LLM(model=args.draft_model, dtype="int4", progress=False, enable_prefix_caching=False)
    configs = [config(c, drafter) for c in args.configs]
    if set_paired is None and not all(paired for _, paired in configs):
        raise SystemExit("int4_paired: these kernels have no set_int4_paired switch")
    prompts = [p for spec in args.prompts.split(",") for p in load_prompts(spec, limit=args.limit)]
    texts = [llm.apply_chat_template([{"role": "user", "content": p.text}]) if p.chat else p.text for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    for spec, _ in configs:  # warm-up: kernels, caches, the drafter's first load
        llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=16), speculative=spec)
    stats = [[] for _ in configs]
    for i, text in enumerate(texts):
        order = range(len(configs)) if i % 2 == 0 else reversed(range(len(configs)))
        outs = {}
        for j in order:
            spec, paired = configs[j]
            if set_paired is not None:
                set_paired(paired)
            outs[j] = llm.generate([text], params, speculative=spec)[0]
            stats[j].append(outs[j].stats)
        if any(o.token_ids != outs[0].token_ids for o in outs.values()):
            raise SystemExit(f"prompt {i}: the configurations' outputs differ")
    if set_paired is not None:
        set_paired(True)
    print(f"{len(texts)} prompts, {args.max_new_tokens} new tokens, outputs identical")
    for text, st in zip(args.configs, (merge(s) for s in stats)):
        steps = max(1, st.verifier_forwards)
        print(f"{text}: decode {st.decode_tokens_per_s:.2f} tok/s, tau {st.mean_accepted_length:.2f}, "
              f"drafted {st.drafted / steps:.2f} a step, verify {1e3 * st.verify_time / steps:.1f} ms and "
              f"draft {1e3 * st.draft_time / steps:.1f} ms a step")


if __name__ == "__main__":
    main()
