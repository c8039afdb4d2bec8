"""The drafter's precision under the default (gguf) verifier: the 1.5B plain against the 0.5B
drafting at gguf and at int4, interleaved per prompt in one process (decode tok/s, tau, and
whether each output equals plain decoding's).

    .venv/bin/python scripts/drafter_dtype.py 3        # HumanEval's first 3 prompts
"""
import sys

from forerun import LLM, SamplingParams, SpeculativeConfig
from forerun.metrics import merge
from forerun.prompts import load_prompts

v = LLM("qwen2.5-coder-1.5b", progress=False)
drafts = {d: LLM("qwen2.5-coder-0.5b", dtype=d, progress=False) for d in ("gguf", "int4")}
cfgs = {"plain": None}
for d, m in drafts.items():
    cfgs[f"{d} k4 lookup1"] = SpeculativeConfig("draft_model", 4, draft_model=m, options={"draft_vocab": 32768, "draft_lookup": 1})
cfgs["int4 k5"] = SpeculativeConfig("draft_model", 5, draft_model=drafts["int4"], options={"draft_vocab": 32768})
ps = load_prompts("humaneval", limit=int(sys.argv[1]) if len(sys.argv) > 1 else 3)
texts = [v.apply_chat_template([{"role": "user", "content": p.text}]) for p in ps]
params = SamplingParams(temperature=0, max_tokens=128)
for c in cfgs.values():
    v.generate(texts[:1], SamplingParams(temperature=0, max_tokens=8), speculative=c)
rates = {k: [] for k in cfgs}
outs = {k: [] for k in cfgs}
for t in texts:
    for k, c in cfgs.items():
        o = v.generate([t], params, speculative=c)[0]
        rates[k].append(o.stats); outs[k].append(o.token_ids)
for k in cfgs:
    s = merge(rates[k])
    print(f"{k}: decode {s.decode_tokens_per_s:.1f} tok/s, tau {s.mean_accepted_length:.2f}, identical {outs[k] == outs['plain']}")
