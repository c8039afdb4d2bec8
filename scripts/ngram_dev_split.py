"""The dev-split check behind the n-gram drafter's defaults (prompts 4-6 of four sets, never
the first three that the drafter matrix reports on).

    .venv/bin/python scripts/ngram_dev_split.py

Measured on the 2-core CPU, SmolLM2 float32, greedy, 64 tokens, 12 prompts:
min1 k5 1.127x, min2 k5 1.234x, min1 k3 1.064x, min2 k3 1.160x, min3 k5 1.222x.
"""
from forerun.bench.compare import run_pair, summarize
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.prompts import load_prompts

CONFIGS = {f"min{n} k{k}": SpeculativeConfig("ngram", k, ngram_min=n) for n, k in [(1, 5), (2, 5), (1, 3), (2, 3), (3, 5)]}


def main():
    llm = LLM(progress=False)
    params = SamplingParams(temperature=0, max_tokens=64)
    prompts = []
    for s in ["humaneval", "spec_bench:summarization", "spec_bench:math_reasoning", "spec_bench:mt_bench"]:
        prompts += load_prompts(s, limit=6)[3:6]
    for label, spec in CONFIGS.items():
        runs = [run_pair(llm, p, params, spec, spec_first=bool(i % 2)) for i, p in enumerate(prompts)]
        r = summarize(llm, runs, params, spec)
        s = r["speculative"]
        print(f"{label}: speedup {r['speedup']:.3f} acceptance {s['acceptance_rate']:.3f} tau {s['mean_accepted_length']:.2f}")


if __name__ == "__main__":
    main()
