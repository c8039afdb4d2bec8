"""Cross-tokenizer drafting, side by side with transformers' universal assisted generation.

    .venv/bin/python scripts/cross_tokenizer_bench.py --limit 3 --max-new-tokens 48

Verifier Gemma 3 270M (base), drafter SmolLM2-135M-Instruct (another tokenizer), greedy,
float32, raw HumanEval prompts. Four engines per prompt, order rotated: forerun plain,
forerun cross-tokenizer speculative, transformers plain, transformers assisted generation
(assistant_model + both tokenizers). transformers reads the same converted folders.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.embedded import default_model_dir, gemma3_model_dir
from forerun.llm import LLM
from forerun.prompts import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    import transformers

    gemma_dir, smol_dir = gemma3_model_dir(), default_model_dir()
    verifier, draft = LLM(str(gemma_dir), progress=False), LLM(str(smol_dir), progress=False)
    spec = SpeculativeConfig("draft_model", args.k, draft_model=draft)
    hf_v = transformers.AutoModelForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32).eval()
    hf_d = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    tok_v = transformers.AutoTokenizer.from_pretrained(str(gemma_dir))
    tok_d = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    hf_kw = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)

    def forerun_plain(ids):
        return verifier.generate([ids], params, speculative=None)[0].token_ids

    def forerun_spec(ids):
        return verifier.generate([ids], params, speculative=spec)[0].token_ids

    def hf_plain(ids):
        with torch.inference_mode():
            return hf_v.generate(torch.tensor([ids]), **hf_kw)[0, len(ids):].tolist()

    def hf_assisted(ids):
        with torch.inference_mode():
            out = hf_v.generate(torch.tensor([ids]), assistant_model=hf_d, tokenizer=tok_v, assistant_tokenizer=tok_d, **hf_kw)
        return out[0, len(ids):].tolist()

    engines = {"forerun_plain": forerun_plain, "forerun_cross_tokenizer": forerun_spec,
               "transformers_plain": hf_plain, "transformers_assisted": hf_assisted}
    totals = {n: [0, 0.0] for n in engines}
    same = {n: 0 for n in engines}
    prompts = load_prompts("humaneval", limit=args.limit)
    for i, p in enumerate(prompts):
        ids = verifier.encode([p.text])[0]
        names = list(engines)
        outs = {}
        for n in names[i % 4:] + names[: i % 4]:
            t = time.perf_counter()
            outs[n] = engines[n](ids)
            totals[n][0] += len(outs[n])
            totals[n][1] += time.perf_counter() - t
        for n in engines:
            same[n] += outs[n] == outs["forerun_plain"]
        print(p.id, {n: round(len(o) / 1, 1) for n, o in outs.items()}, file=sys.stderr, flush=True)
    report = {n: {"tokens_per_s": c / t, "same_as_forerun_plain": f"{same[n]}/{len(prompts)}"} for n, (c, t) in totals.items()}
    for n in engines:
        report[n]["vs_own_plain"] = report[n]["tokens_per_s"] / report[
            "transformers_plain" if n.startswith("transformers") else "forerun_plain"]["tokens_per_s"]
    report.update(k=args.k, max_new_tokens=args.max_new_tokens, prompts=f"humaneval x{len(prompts)}")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
