"""The dev-split check behind the n-gram drafter's defaults (prompts 4-6 of four sets, never
the first three that the bench's drafter matrix reports on).

    .venv/bin/python scripts/ngram_dev_split.py

It runs the bench's grid (forerun/bench/grid.py: plain and every config interleaved per
prompt) on one workload of the 12 dev prompts. Measured on the 2-core CPU, SmolLM2 float32,
greedy, 64 tokens, with the earlier pairwise runner (each config against its own plain runs):
min1 k5 1.127x, min2 k5 1.234x, min1 k3 1.064x, min2 k3 1.160x, min3 k5 1.222x.
"""
from forerun.bench.bench import prompt_ids
from forerun.bench.cell import summarize_cell
from forerun.bench.grid import Workload, make_methods, refuse, run_workload, warm_up
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
    work = Workload("dev", [(p.id, prompt_ids(llm, p)) for p in prompts])
    methods = make_methods(llm, list(CONFIGS.values()), labels=list(CONFIGS))
    refuse(warm_up(llm, methods, work.prompts[0][1]))
    pairs = run_workload(llm, methods, work, params)
    for m in methods:
        c = summarize_cell(work.category, m.label, m.k, pairs[m.label], greedy=True)
        print(f"{m.label}: speedup {c['speedup']:.3f} acceptance {c['acceptance_rate']:.3f} tau {c['tau']:.2f}")


if __name__ == "__main__":
    main()
