"""forerun vs transformers on the Qwen2.5-Coder pair, greedy, same prompts, one process.

    .venv/bin/python scripts/peers_qwen.py --limit 3 --max-new-tokens 64 --out peers.json

transformers reads the same GGUF files at float32 (its `generate`, plain and with
`assistant_model` = the 0.5B); forerun runs plain and draft-model decoding at float32 (int8
drafter) and int8. Engines rotate per prompt; each figure is generated tokens / wall time,
prefill included. llama.cpp is measured outside Python (see the README).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from forerun.bench.bench import prompt_ids
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.embedded import QWEN_MODELS, ensure_chunked_gguf
from forerun.llm import LLM
from forerun.prompts import load_prompts


def _hf_model(gguf):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def _hf(model, ids, max_new, eos, assistant=None):
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0], assistant_model=assistant)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def _fr(llm, spec, ids, max_new):
    t = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_new), speculative=spec)[0]
    return out.token_ids, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="peers.json")
    args = ap.parse_args()
    big, small = (ensure_chunked_gguf(QWEN_MODELS[n]) for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    f32 = LLM("qwen2.5-coder-1.5b", dtype="float32", progress=False)
    int8 = LLM("qwen2.5-coder-1.5b", dtype="int8", progress=False)
    draft = SpeculativeConfig("draft_model", 5, draft_model="qwen2.5-coder-0.5b", draft_dtype="int8")
    hf, hf_small = _hf_model(big), _hf_model(small)
    eos = sorted(f32._eos_ids())
    engines = {
        "transformers float32": lambda ids: _hf(hf, ids, args.max_new_tokens, eos),
        "transformers float32 + assistant 0.5B": lambda ids: _hf(hf, ids, args.max_new_tokens, eos, hf_small),
        "forerun float32": lambda ids: _fr(f32, None, ids, args.max_new_tokens),
        "forerun float32 + draft 0.5B int8": lambda ids: _fr(f32, draft, ids, args.max_new_tokens),
        "forerun int8": lambda ids: _fr(int8, None, ids, args.max_new_tokens),
        "forerun int8 + draft 0.5B int8": lambda ids: _fr(int8, draft, ids, args.max_new_tokens),
    }
    warm = prompt_ids(f32, load_prompts(args.prompts, limit=1)[0])
    for name in engines:  # builds the drafters and warms every path before anything is timed
        print(f"warming up {name}...", file=sys.stderr, flush=True)
        engines[name](warm[:64])
    totals = {name: [0, 0.0] for name in engines}
    outputs: dict[str, list] = {name: [] for name in engines}
    for i, p in enumerate(load_prompts(args.prompts, limit=args.limit)):
        ids = prompt_ids(f32, p)
        order = list(engines)
        for name in order[i % len(order):] + order[: i % len(order)]:
            toks, dt = engines[name](ids)
            totals[name][0] += len(toks)
            totals[name][1] += dt
            outputs[name].append(toks)
            print(f"{p.id} {name}: {len(toks) / dt:.2f} tok/s", file=sys.stderr, flush=True)
    ref = outputs["transformers float32"]
    report = {name: {"tokens": n, "seconds": t, "tokens_per_s": n / t,
                     "same_tokens_as_transformers_float32": sum(a == b for a, b in zip(outputs[name], ref))}
              for name, (n, t) in totals.items()}
    report["same_tokens_int8_spec_vs_int8_plain"] = sum(a == b for a, b in zip(outputs["forerun int8 + draft 0.5B int8"], outputs["forerun int8"]))
    report.update(prompts=args.prompts, n_prompts=args.limit, max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads())
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
