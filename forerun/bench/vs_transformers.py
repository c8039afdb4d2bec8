"""forerun vs transformers' `generate`, greedy, same prompts, one process.

forerun runs plain at float32 and int8, and with the n-gram drafter (k=5) at int8; the
"same tokens" column compares each with transformers' float32 output.

    python -m forerun.bench.vs_transformers --prompts spec_bench:summarization --limit 5

Needs the test extras (transformers, accelerate). Engines alternate per prompt so machine
noise lands on all of them; each figure is generated tokens / wall time, prefill included.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from forerun.bench.compare import prompt_ids
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.prompts import load_prompts


def _hf_model(gguf):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def _time_hf(model, ids: list[int], max_new: int, eos: list[int]) -> tuple[list[int], float]:
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def _time_forerun(llm: LLM, spec: SpeculativeConfig | None, ids: list[int], max_new: int) -> tuple[list[int], float]:
    t = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_new), speculative=spec)[0]
    return out.token_ids, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="spec_bench:summarization")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    from forerun.embedded import ensure_default_gguf

    f32, int8 = LLM(dtype="float32", progress=False), LLM(dtype="int8", progress=False)
    engines = {"forerun_float32": (f32, None), "forerun_int8": (int8, None), "forerun_int8_ngram": (int8, SpeculativeConfig("ngram", 5))}
    hf = _hf_model(ensure_default_gguf())
    eos = sorted(f32._eos_ids())
    totals = {name: [0, 0.0] for name in [*engines, "transformers_float32"]}
    same = {name: 0 for name in engines}
    same_as_plain_int8 = 0  # int8's match share: speculative vs plain at the same precision
    prompts = load_prompts(args.prompts, limit=args.limit, data_dir=args.data_dir)
    for i, p in enumerate(prompts):
        ids = prompt_ids(f32, p)
        order = list(engines) + ["transformers_float32"]
        outs = {}
        for name in order[i % len(order) :] + order[: i % len(order)]:  # rotate who runs first
            if name == "transformers_float32":
                outs[name] = _time_hf(hf, ids, args.max_new_tokens, eos)
            else:
                outs[name] = _time_forerun(*engines[name], ids, args.max_new_tokens)
            totals[name][0] += len(outs[name][0])
            totals[name][1] += outs[name][1]
        for name in engines:
            same[name] += outs[name][0] == outs["transformers_float32"][0]
        same_as_plain_int8 += outs["forerun_int8_ngram"][0] == outs["forerun_int8"][0]
        print(f"{p.id}: " + ", ".join(f"{n} {len(o[0]) / o[1]:.1f} tok/s" for n, o in outs.items()), file=sys.stderr)
    report = {name: {"tokens": n, "seconds": t, "tokens_per_s": n / t} for name, (n, t) in totals.items()}
    hf_tps = report["transformers_float32"]["tokens_per_s"]
    for name in engines:
        report[name]["vs_transformers"] = report[name]["tokens_per_s"] / hf_tps
        report[name]["same_tokens_as_transformers"] = f"{same[name]}/{len(prompts)}"
    report["forerun_int8_ngram"]["same_tokens_as_forerun_int8"] = f"{same_as_plain_int8}/{len(prompts)}"
    report.update(prompts=args.prompts, n_prompts=len(prompts), max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads())
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
