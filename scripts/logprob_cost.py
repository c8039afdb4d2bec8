"""The cost of logprobs on decoding: the same greedy generation with logprobs off and on (top 5),
plain and with n-gram speculation, alternated round by round (medians of tokens/s).

    .venv/bin/python scripts/logprob_cost.py --model smollm2-135m --rounds 4
"""
import argparse
import statistics
import time

from forerun import LLM, SamplingParams, SpeculativeConfig

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and three doctests."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, progress=False)
    prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    methods = {"plain": None, "ngram k=4": SpeculativeConfig("ngram", 4)}
    rates = {(m, on): [] for m in methods for on in (False, True)}
    for _ in range(args.rounds):
        for name, spec in methods.items():
            for on in (False, True):
                params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True, logprobs=5 if on else None)
                t = time.perf_counter()
                out = llm.generate(prompt, params, speculative=spec)[0]
                rates[(name, on)].append(len(out.token_ids) / (time.perf_counter() - t))
    for name in methods:
        off, on = statistics.median(rates[(name, False)]), statistics.median(rates[(name, True)])
        print(f"{llm.name} {llm.dtype} {name}: logprobs off {off:.1f} tok/s, on (top 5) {on:.1f} tok/s, {on / off:.3f}x")


if __name__ == "__main__":
    main()
