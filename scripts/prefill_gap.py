"""How long a running stream waits between tokens while a long prompt arrives: chunked prefill
(`--prefill-chunk`, `--prefill-chunk-seconds`) against whole prompts at admission, one server in
this process each.

    python scripts/prefill_gap.py --model qwen2.5-coder-1.5b --tokens 6144 --chunks 0,128,128:0.5

Stream A (a short prompt, --max-tokens new tokens, greedy) starts; once it has streamed 8 tokens
a newcomer B with a --tokens-token prompt (a standard-library module's source) is sent. Prints A's
gaps between streamed chunks: the median, the 99th percentile and the largest, per setting: N
(chunks of N tokens; 0: whole prompts) or N:S (chunks sized to take about S seconds, at most N
tokens). The model is built off a thread that exits (serve/one_pool.py), as `forerun serve` does.

With --draft-model (drafting at --k), the draft model's own cache takes each prompt too:
--drafter-feed chunked (the server's way: the verifier's chunks, as they are computed) or
first-step (as before commit f0101ab: the whole prompt inside the row's first drafting step).

    python scripts/prefill_gap.py --tokens 6144 --chunks 128:0.5 --max-tokens 500 \
        --draft-model qwen2.5-coder-0.5b --k 3 --drafter-feed chunked,first-step
"""
import argparse
import difflib
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from forerun.bench.launch import serve_in_thread
from forerun.bench.loadgen import percentile
from forerun.config import SpeculativeConfig
from forerun.llm import LLM
from forerun.serve.main import build_server
from forerun.serve.one_pool import built_off_thread
from forerun.serve.scheduler import ServeConfig


def gaps_under_newcomer(url: str, newcomer: str, max_tokens: int, newcomer_tokens: int = 4) -> list[float]:
    """A's gaps between streamed chunks, B (newcomer_tokens new tokens) sent after A's 8th chunk."""
    body = {"messages": [{"role": "user", "content": "Count from 1 to 200, one number a line."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    late = {"messages": [{"role": "user", "content": newcomer}], "max_tokens": newcomer_tokens, "temperature": 0}
    stamps, sender = [], None
    with httpx.Client(base_url=url, timeout=3600) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {") or not json.loads(line[6:])["choices"]:
                continue
            stamps.append(time.perf_counter())
            if len(stamps) == 8:
                sender = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json=late, timeout=3600))
                sender.start()
    sender.join()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--tokens", type=int, default=1024, help="the newcomer's prompt tokens")
    ap.add_argument("--chunks", default="0,128,128:0.5",
                    help="comma-separated settings: N (--prefill-chunk N, --prefill-chunk-seconds 0; 0: whole prompts) "
                         "or N:S (--prefill-chunk N --prefill-chunk-seconds S)")
    ap.add_argument("--max-tokens", type=int, default=160, help="stream A's new tokens")
    ap.add_argument("--newcomer-tokens", type=int, default=4, help="the newcomer's new tokens")
    ap.add_argument("--draft-model", default=None, help="draft with this model (its int4 default), k = --k")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--drafter-feed", default="chunked", help="comma-separated: chunked, first-step (see above)")
    args = ap.parse_args()
    llm = built_off_thread(lambda: LLM(args.model, dtype=args.dtype, progress=False, enable_prefix_caching=False))
    spec = SpeculativeConfig("draft_model", args.k, draft_model=args.draft_model) if args.draft_model else None
    ids = llm.tokenizer.encode(Path(difflib.__file__).read_text())[: args.tokens]
    newcomer = llm.decode(ids)
    feeds = args.drafter_feed.split(",") if spec else ["-"]
    for setting, feed in [(s, f) for s in args.chunks.split(",") for f in feeds]:
        chunk, _, seconds = setting.partition(":")
        cfg = ServeConfig(max_batch=2, max_len=args.tokens + max(256, args.newcomer_tokens + 16), prefill_chunk=int(chunk) or None,
                          prefill_chunk_seconds=float(seconds) if seconds else None, prefix_cache=False)
        app = build_server(llm, spec, cfg, default_max_tokens=args.max_tokens)
        if feed == "first-step":  # the drafter sees no prefill chunk: its first step feeds the prompt
            app.state.scheduler.drafter.observe_prefix = lambda items: None
        server, url = serve_in_thread(app)
        try:
            gaps = gaps_under_newcomer(url, newcomer, args.max_tokens, args.newcomer_tokens)
        finally:
            server.should_exit = True
            time.sleep(1)
        print(f"{setting}{'' if feed == '-' else ' ' + feed}: stream A's gaps median {statistics.median(gaps):.3f} s, "
              f"p99 {percentile(gaps, 0.99):.2f} s, max {max(gaps):.2f} s ({len(gaps)} gaps, {sum(gaps):.1f} s from A's first "
              f"streamed chunk to its last; newcomer {len(ids)} tokens)",
              flush=True)


if __name__ == "__main__":
    main()
