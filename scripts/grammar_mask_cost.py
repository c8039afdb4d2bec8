"""What structured outputs cost per decoding step: the grammar mask for one row, per token, on a
real tokenizer, for a tool-call JSON schema (forerun/structured, llguidance).

Masks are timed along two kinds of output: the canonical tokens of model-like tool calls, and
seeded random walks through the grammar (any allowed token, so strings wander through the whole
vocabulary: the harder case). Also the one-off costs: the engine's token table, a first compile,
a cache hit, a row's matcher.

    .venv/bin/python scripts/grammar_mask_cost.py --model ~/.cache/forerun/models/Qwen2.5-Coder-1.5B-Instruct
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from forerun.structured import GrammarCompiler, StructuredOutputs, fill_masks
from forerun.tokenizer import Tokenizer

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["read_file", "write_file", "run_tests", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 80},
                "line": {"type": "integer", "minimum": 1},
                "query": {"type": "string", "maxLength": 200},
                "recursive": {"type": "boolean"},
            },
            "required": ["path", "line"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CALLS = [
    {"name": "read_file", "arguments": {"path": "forerun/structured/matcher.py", "line": 120}},
    {"name": "search", "arguments": {"path": "forerun/", "line": 1, "query": "def rollback(self, n: int)", "recursive": True}},
    {"name": "write_file", "arguments": {"path": "tests/test_structured_matcher.py", "line": 42,
                                         "query": "assert m.check_draft(draft) == len(draft)"}},
]


def _us(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p90, p99 = (ordered[int(q * (len(ordered) - 1))] for q in (0.9, 0.99))
    return (f"median {statistics.median(ordered) * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us, "
            f"mean {statistics.fmean(ordered) * 1e6:.0f} us (n={len(ordered)})")


def _walk(compiler, spec, tokens_or_pick, width) -> list[float]:
    """Time mask(width) at each position of one output; the next token is given or picked."""
    m, times = compiler.matcher(spec), []
    tokens = list(tokens_or_pick) if not callable(tokens_or_pick) else None
    for i in range(400):
        t = time.perf_counter()
        mask = m.mask(width)
        times.append(time.perf_counter() - t)
        token = tokens[i] if tokens is not None and i < len(tokens) else None
        if token is None:
            if tokens is not None:
                break
            token = tokens_or_pick(mask.nonzero().flatten().tolist())
        if token in m.eos_ids or not m.advance(token):
            break
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model folder with tokenizer.json (and config.json for the logit width)")
    ap.add_argument("--walks", type=int, default=12)
    args = ap.parse_args()
    folder = Path(args.model).expanduser()
    tokenizer = Tokenizer.from_pretrained(folder)
    width = json.loads((folder / "config.json").read_text()).get("vocab_size", tokenizer.vocab_size)
    compiler = GrammarCompiler(tokenizer)
    spec = StructuredOutputs(json=TOOL_CALL)

    t = time.perf_counter(); compiler.compile(StructuredOutputs(regex="x"))
    print(f"{folder.name}: {tokenizer.vocab_size} tokens, {width} logits; "
          f"engine token table + first compile {time.perf_counter() - t:.2f} s")
    t = time.perf_counter(); compiler.compile(spec)
    print(f"tool-call schema: compile {(time.perf_counter() - t) * 1e3:.1f} ms", end="")
    t = time.perf_counter(); compiler.compile(spec)
    print(f", cache hit {(time.perf_counter() - t) * 1e6:.0f} us", end="")
    t = time.perf_counter(); rows = [compiler.matcher(spec) for _ in range(100)]
    print(f", a row's matcher {(time.perf_counter() - t) * 1e4:.1f} us")

    canonical = [x for call in CALLS * 4 for x in _walk(
        compiler, spec, tokenizer.encode(json.dumps(call, separators=(",", ":")), add_special_tokens=False), width)]
    print(f"mask per token, model-like tool calls: {_us(canonical)}")
    walks = [x for seed in range(args.walks) for x in _walk(compiler, spec, random.Random(seed).choice, width)]
    print(f"mask per token, random walks:         {_us(walks)}")

    m = compiler.matcher(spec)
    t = time.perf_counter(); run = m.forced(16)
    print(f"forced run at the start: {len(run)} tokens {tokenizer.decode(run)!r} in {(time.perf_counter() - t) * 1e6:.0f} us")
    draft = tokenizer.encode(json.dumps(CALLS[1], separators=(",", ":")), add_special_tokens=False)[:8]
    t = time.perf_counter(); masks = m.draft_masks(draft, width)
    print(f"draft_masks for a {len(draft)}-token draft: {masks.shape[0]} rows in {(time.perf_counter() - t) * 1e6:.0f} us")
    batch = [compiler.matcher(spec) for _ in range(8)]
    for row, call in zip(batch, CALLS * 3):
        for token in tokenizer.encode(json.dumps(call, separators=(",", ":")), add_special_tokens=False)[:20]:
            row.advance(token)
    out = torch.zeros(len(batch), width, dtype=torch.bool)
    batched, looped = [], []
    for _ in range(20):  # the same states: the engine's own caches make these the cheap case
        t = time.perf_counter(); fill_masks(batch, out); batched.append(time.perf_counter() - t)
        t = time.perf_counter(); [row.mask(width) for row in batch]; looped.append(time.perf_counter() - t)
    print(f"8 rows (medians of 20): fill_masks {statistics.median(batched) * 1e6:.0f} us, "
          f"one by one {statistics.median(looped) * 1e6:.0f} us")
    del rows


if __name__ == "__main__":
    main()
