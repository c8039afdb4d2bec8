"""The same request through `LLM.generate` and through `forerun serve`, alternated: decode tok/s
and time to first token (prefill) of each, so the server's cost over the library shows at
agent-sized contexts.

    python scripts/serve_vs_llm.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --context 2048

The prompt is a chat turn holding a standard-library module's source, cut to --context tokens.
The server is `forerun serve` in a process of its own (as users run it; one process per side,
so neither side's OpenMP pool slows the other's: serve/one_pool.py), with its defaults (paged
KV, prefix cache on, batch-aware k) unless --no-paged / --no-prefix-cache say otherwise; its
prefix cache is reset before each of its rounds. Greedy, --max-tokens new tokens; the
library's figures come from its stats (prefill_time, decode_time), the server's from the
stream (TTFT, then the rest of the tokens over the rest of the time).
"""
import argparse
import difflib
import json
import statistics
import sys
from pathlib import Path

import httpx

from forerun.bench.launch import Launched, free_port
from forerun.bench.sessions import stream_chat
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM


def prompt_messages(llm: LLM, context: int) -> list[dict]:
    source = Path(difflib.__file__).read_text()
    ids = llm.tokenizer.encode(source)[: max(16, context - 40)]
    return [{"role": "user", "content": "Here is a file:\n" + llm.decode(ids) + "\nExplain what its first class does."}]


def via_llm(llm: LLM, messages, params, spec) -> dict:
    out = llm.chat(messages, params, speculative=spec)[0]
    s = out.stats
    return {"ttft_s": s.prefill_time, "decode_tok_s": (s.generated - 1) / s.decode_time if s.decode_time else 0.0,
            "tokens": s.generated, "tau": s.mean_accepted_length, "text": out.text}


def via_server(url: str, messages, max_tokens: int) -> dict:
    with httpx.Client(base_url=url, timeout=3600) as client:
        client.post("/reset_prefix_cache").raise_for_status()  # each round cold: the prompt is the same
        t = stream_chat(client, messages, max_tokens)
    return {"ttft_s": t.ttft, "decode_tok_s": t.decode_tok_s, "tokens": t.tokens, "cached": t.cached_tokens, "text": t.text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--draft-model", default=None, help="a draft model (draft_model, k --k); none: plain decoding")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-paged", action="store_true")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--log", default="serve_vs_llm.log", help="the server's output")
    args = ap.parse_args()
    spec = None
    if args.draft_model:
        spec = SpeculativeConfig("draft_model", args.k, draft_model=args.draft_model, draft_dtype="int4",
                                 options={"draft_lookup": 1})
    llm = LLM(args.model, dtype=args.dtype, speculative=spec, progress=False, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    messages = prompt_messages(llm, args.context)
    port = free_port()
    argv = [sys.executable, "-m", "forerun.cli", "serve", "--model", args.model, "--dtype", args.dtype, "--port", str(port),
            "--max-batch", "4", "--max-len", str(args.context + args.max_tokens + 64),
            "--max-new-tokens", str(args.max_tokens), *(["--no-paged"] if args.no_paged else []),
            *(["--no-prefix-cache"] if args.no_prefix_cache else []), "--method", "none"]
    if spec is not None:
        argv += ["--method", "draft_model", "--draft-model", args.draft_model, "--draft-dtype", "int4", "--k", str(args.k),
                 "--draft-lookup", "1"]
    rows = {"llm": [], "serve": []}
    with Launched(argv, port, Path(args.log)) as url:
        for r in range(args.rounds):
            for side in ("llm", "serve")[:: 1 if r % 2 == 0 else -1]:
                got = via_llm(llm, messages, params, spec) if side == "llm" else via_server(url, messages, args.max_tokens)
                rows[side].append(got)
                print(json.dumps({"round": r, "side": side, **{k: v for k, v in got.items() if k != "text"}}), flush=True)
    same = all(a["text"] == b["text"] for a, b in zip(rows["llm"], rows["serve"]))
    for side, got in rows.items():
        print(f"{side:5s}: decode {statistics.median(g['decode_tok_s'] for g in got):6.2f} tok/s, "
              f"TTFT {statistics.median(g['ttft_s'] for g in got):6.2f} s")
    ratio = statistics.median(g["decode_tok_s"] for g in rows["serve"]) / statistics.median(g["decode_tok_s"] for g in rows["llm"])
    print(f"serve / llm decode: {ratio:.3f}; same text: {same}; context {args.context} tokens")


if __name__ == "__main__":
    main()
