"""A small load generator for a running OpenAI-style server (`forerun serve`, or llama.cpp's
`llama-server`): C concurrent streaming chat clients, each sending R greedy requests one after
another; throughput and per-request latency (p50/p95). `forerun.bench.matrix` drives it over
server configurations; alone it measures a server that is already running:

    python -m forerun.bench.loadgen --url http://127.0.0.1:8000 --clients 1,4,8 --speculative server,none

Client i's j-th request is PROMPTS[(i + j) % len(PROMPTS)], so every record carries its prompt
index (`prompt`) and its text, which is how greedy identity under concurrency is checked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Rewrite this function with type hints, keeping the body unchanged:\n\ndef area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n",
    "Repeat the following list exactly, one item per line, then add one more fruit: apple, banana, cherry, damson, elderberry, fig, grape.",
    "Explain what a KV cache is in a transformer, in three sentences.",
    "Fix the bug and return the whole corrected function:\n\ndef find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n < best:\n            best = n\n    return best\n",
]


def spec_body(spec: str) -> dict:
    """Body fields for loadgen's --speculative value: 'server' sends none (the server's own
    method and k), anything else is forerun's per-request `"speculative": {"method": spec}`."""
    return {} if spec == "server" else {"speculative": {"method": spec}}


@dataclass
class ChatStream:
    """What a streamed chat completion's SSE lines say, fed one line at a time: the time to its
    first text (from t0), its text pieces, the last usage and llama-server's `timings`."""

    t0: float
    first: float | None = None
    pieces: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def feed(self, line: str) -> None:
        if not line.startswith("data: {"):
            return
        chunk = json.loads(line[6:])
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and self.first is None:
                self.first = time.perf_counter() - self.t0
            self.pieces.append(piece)


async def one(client: httpx.AsyncClient, prompt: int, max_tokens: int, extra: dict) -> dict:
    """Stream PROMPTS[prompt] greedily; its latency, time to first token, completion tokens
    (the server's usage count), text, and the draft tokens scored / accepted where the server
    reports them per request (llama-server's `timings`; else None). `extra`: more body fields."""
    body = {"messages": [{"role": "user", "content": PROMPTS[prompt]}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    s = ChatStream(time.perf_counter())
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            s.feed(line)
    return {"prompt": prompt, "latency": time.perf_counter() - s.t0, "ttft": s.first or 0.0,
            "tokens": s.usage.get("completion_tokens", 0), "text": "".join(s.pieces),
            "drafted": s.timings.get("draft_n"), "accepted": s.timings.get("draft_n_accepted")}


async def run(url: str, clients: int, per_client: int, max_tokens: int, extra: dict) -> tuple[list[dict], float]:
    """`clients` concurrent clients, `per_client` requests each; the records and the wall time.
    A fresh connection per request: llama-server closes one after a stream, and a pooled
    connection it has closed fails the next request ("Server disconnected")."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def worker(i: int) -> list[dict]:
            return [await one(client, (i + j) % len(PROMPTS), max_tokens, extra) for j in range(per_client)]

        t0 = time.perf_counter()
        done = [r for rs in await asyncio.gather(*[worker(i) for i in range(clients)]) for r in rs]
        return done, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 0.95), percentile([4.0, 1.0, 3.0, 2.0], 0.5)
    (4.0, 2.0)
    >>> percentile(list(range(1, 21)), 0.95)
    19
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(records: list[dict], wall: float) -> dict:
    """Throughput (completion tokens / wall time) and latency figures of one load run.

    >>> summarize([{"latency": 1.0, "ttft": 0.1, "tokens": 10}, {"latency": 3.0, "ttft": 0.3, "tokens": 30}], 4.0)
    {'requests': 2, 'tokens': 40, 'wall_s': 4.0, 'tok_per_s': 10.0, 'p50_s': 2.0, 'p95_s': 3.0, 'ttft_p50_s': 0.2}
    """
    lat = [r["latency"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 2),
            "p50_s": round(statistics.median(lat), 2), "p95_s": round(percentile(lat, 0.95), 2),
            "ttft_p50_s": round(statistics.median(r["ttft"] for r in records), 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m forerun.bench.loadgen", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speculative", default="server,none",
                   help="per-request setting: 'server' (the server's method and k), 'none', or a method name")
    args = p.parse_args(argv)
    for spec in args.speculative.split(","):
        for c in [int(x) for x in args.clients.split(",")]:
            records, wall = asyncio.run(run(args.url, c, args.per_client, args.max_tokens, spec_body(spec)))
            print(json.dumps({"clients": c, "speculative": spec, **summarize(records, wall)}), flush=True)


if __name__ == "__main__":
    main()
