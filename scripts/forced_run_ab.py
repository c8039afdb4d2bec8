"""JSON extraction with suffix drafting: continuing after the grammar's forced run or not,
alternated task by task in one process, beside plain constrained decoding.

    python scripts/forced_run_ab.py --tasks 10

Each task (a standard-library function's signature and docstring, described under the strict
extraction schema of forerun.bench.structured) runs plain, suffix k 8 with
`options["grammar_continue"]: false` (the forced run leads the draft; the drafter's draft is
kept only where it begins with the run) and suffix k 8 as by default (the drafter is asked to
continue after the run), in turns, the order reversed every other task, so the machine's drift
hits all three alike. Each configuration has its own LLM, so each suffix store keeps its own
earlier outputs as a server's would. Prints decode tok/s (the prefill left out), its ratio to
plain, verifier forwards, tau and forced tokens; the three outputs must be the same tokens.
"""
import argparse
import collections

import torch

from forerun import LLM, SamplingParams
from forerun.bench.structured import SCHEMA, body, tasks
from forerun.config import SpeculativeConfig
from forerun.structured.spec import StructuredOutputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = {
        "plain": None,
        "suffix, run only": SpeculativeConfig("suffix", args.k, options={"grammar_continue": False}),
        "suffix, after the run": SpeculativeConfig("suffix", args.k),
    }
    llms = {c: LLM(args.model, dtype=args.dtype, progress=False) for c in configs}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=StructuredOutputs(json=SCHEMA))
    totals = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # tokens, decode s, forwards, forced
    names = list(configs)
    for i, (name, source) in enumerate(tasks(args.tasks)):
        messages = body("json", source, args.max_tokens)["messages"]
        ids = {}
        for c in names if i % 2 == 0 else names[::-1]:
            out = llms[c].chat(messages, params, speculative=configs[c])[0]
            s, t = out.stats, totals[c]
            t[0] += s.decoded
            t[1] += s.decode_time
            t[2] += s.verifier_forwards
            t[3] += s.forced
            ids[c] = out.token_ids
        if len({tuple(v) for v in ids.values()}) != 1:
            raise SystemExit(f"{name}: the configurations' outputs differ")
        print(name, "  ".join(f"{c} {totals[c][0] / totals[c][1]:.1f}" for c in names), flush=True)
    base = totals["plain"][0] / totals["plain"][1]
    for c in names:
        g, sec, fw, forced = totals[c]
        print(f"{c}: {g} tokens, decode {g / sec:.2f} tok/s ({g / sec / base:.3f}x plain), {fw} forwards, "
              f"tau {g / fw:.3f}, forced {forced}")
    print("outputs identical in every task: yes")


if __name__ == "__main__":
    main()
