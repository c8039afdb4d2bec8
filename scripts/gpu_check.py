"""One-shot CUDA check: exactness of every drafter on the GPU, and the cost model there.

    PYTHONPATH=. python scripts/gpu_check.py --out results.json

1. Greedy identity (float64 tiny model on CUDA) for every drafter that runs there.
2. Chi-square of draft-model sampling on CUDA (batched, explicit CUDA generator).
3. Verifier cost vs tokens scored per forward, for SmolLM2-135M's shape and a 1B Llama
   shape with random weights (bfloat16 and float32): the quantity that decides whether
   drafting pays. Random weights change no timing; acceptance needs the real model.
"""
from __future__ import annotations

import argparse
import os
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from forerun.config import SamplingParams, SpeculativeConfig  # noqa: E402
from forerun.kv.cache import chain_batch  # noqa: E402
from forerun.llm import LLM  # noqa: E402
from forerun.metrics import merge  # noqa: E402
from forerun.models.config import ModelConfig  # noqa: E402
from forerun.models.llama import LlamaForCausalLM  # noqa: E402
from forerun.models.loader import finish_model  # noqa: E402
from tests.stats_util import chi2_pvalue, joint_distribution  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

DEV = os.environ.get("FORERUN_DEVICE", "cuda")


def on_device(model):
    return finish_model(model.to(DEV), "float64" if model.dtype == torch.float64 else "float32", DEV)


def greedy_identity() -> dict:
    llm = LLM(on_device(tiny_model(seed=0, num_hidden_layers=4)), dtype="float64")
    draft = LLM(on_device(tiny_model(seed=3)), dtype="float64")
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2]]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in llm.generate(prompts, greedy, speculative=None)]
    specs = {
        "ngram": SpeculativeConfig("ngram", 4),
        "ngram_tree": SpeculativeConfig("ngram", 4, ngram_branches=3),
        "draft_model": SpeculativeConfig("draft_model", 4, draft_model=draft),
        "draft_model_tree": SpeculativeConfig("draft_model", 4, draft_model=draft, tree_width=3),
        "layer_skip": SpeculativeConfig("layer_skip", 3, skip_layers=(1, 2)),
        "early_exit": SpeculativeConfig("early_exit", 3, exit_layer=2),
        "lookahead": SpeculativeConfig("lookahead", 5),
    }
    out = {}
    for name, spec in specs.items():
        outs = llm.generate(prompts, greedy, speculative=spec)
        out[name] = {"identical": [o.token_ids for o in outs] == plain, "tau": merge([o.stats for o in outs]).mean_accepted_length}
    return out


def chi_square() -> dict:
    llm = LLM(on_device(tiny_model(seed=0, vocab_size=8)), dtype="float64")
    draft = LLM(on_device(tiny_model(seed=7, vocab_size=8)), dtype="float64")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, seed=2)
    ref = joint_distribution(llm.model, prompt, params)
    outs = llm.generate([prompt] * 20000, params, speculative=SpeculativeConfig("draft_model", 2, draft_model=draft))
    st = merge([o.stats for o in outs])
    return {"p_value": chi2_pvalue([tuple(o.token_ids) for o in outs], ref), "accepted": st.accepted,
            "rejections": st.rejections, "bonus": st.bonus}


SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False,
                               attention_bias=True, rope_theta=1e6, model_type="qwen2"),
    "qwen2.5-coder-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                               attention_bias=True, rope_theta=1e6, model_type="qwen2"),
}


def cost_model(context: int = 512) -> dict:
    out = {}
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            cfg = ModelConfig(max_position_embeddings=4096, **shape)
            with torch.device(DEV):
                m = LlamaForCausalLM(cfg).to(dtype)
            m = finish_model(m, "bfloat16" if dtype == torch.bfloat16 else "float32", DEV)
            cache = m.new_cache(1, context + 64)
            with torch.inference_mode():
                m(chain_batch([[1] * context], [0], [0], m.device), cache, logits_at=None)
                row = {}
                for T in (1, 2, 4, 6, 8, 12, 16, 32):
                    b = chain_batch([[1] * T], [context], [0], m.device)
                    for _ in range(3):
                        m(b, cache)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(20):
                        m(b, cache)
                    torch.cuda.synchronize()
                    row[T] = (time.perf_counter() - t) / 20 * 1e3
            out[f"{name}/{str(dtype).split('.')[-1]}"] = {"ms_per_forward": row, "cost_T_over_1": {T: v / row[1] for T, v in row.items()}}
            del m, cache
            torch.cuda.empty_cache()
    return out


def plain_decode_speed() -> dict:
    """End-to-end plain greedy tokens/s on the SmolLM2 shape (random weights), bf16."""
    cfg = ModelConfig(max_position_embeddings=4096, **SHAPES["smollm2-135m"])
    with torch.device(DEV):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    llm = LLM(finish_model(m, "bfloat16", DEV), dtype="bfloat16")
    ids = list(range(100, 356))
    p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([ids], p, speculative=None)
    out = llm.generate([ids], p, speculative=None)[0]
    return {"tokens_per_s": out.stats.tokens_per_s, "decode_tokens_per_s": out.stats.decode_tokens_per_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in [("greedy_identity", greedy_identity), ("chi_square", chi_square),
                     ("plain_decode", plain_decode_speed), ("cost_model", cost_model)]:
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # record and go on: one failure must not hide the other checks
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        report[name + "_seconds"] = time.perf_counter() - t
        print(name, json.dumps(report[name])[:600], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
