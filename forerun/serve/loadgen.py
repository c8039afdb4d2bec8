"""A small load generator for a running `forerun serve`: C concurrent streaming clients,
each sending R greedy requests; prints throughput and per-request latency (p50/p95).

    python -m forerun.serve.loadgen --url http://127.0.0.1:8000 --clients 1,4,8 --speculative ngram,none
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

PROMPTS = [
    "Rewrite this function with type hints, keeping the body unchanged:\n\ndef area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n",
    "Repeat the following list exactly, one item per line, then add one more fruit: apple, banana, cherry, damson, elderberry, fig, grape.",
    "Explain what a KV cache is in a transformer, in three sentences.",
    "Fix the bug and return the whole corrected function:\n\ndef find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n < best:\n            best = n\n    return best\n",
]


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, spec: str) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if spec != "server":
        body["speculative"] = {"method": spec}
    t0, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter() - t0
    return {"latency": time.perf_counter() - t0, "ttft": first or 0.0, "tokens": tokens}


async def run(url: str, clients: int, per_client: int, max_tokens: int, spec: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker(i: int):
            return [await one(client, PROMPTS[(i + j) % len(PROMPTS)], max_tokens, spec) for j in range(per_client)]

        t0 = time.perf_counter()
        done = [r for rs in await asyncio.gather(*[worker(i) for i in range(clients)]) for r in rs]
        wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in done)
    return {"clients": clients, "speculative": spec, "requests": len(done), "tokens": sum(r["tokens"] for r in done),
            "wall_s": round(wall, 2), "tok_per_s": round(sum(r["tokens"] for r in done) / wall, 2),
            "p50_s": round(statistics.median(lat), 2), "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2),
            "ttft_p50_s": round(statistics.median(r["ttft"] for r in done), 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m forerun.serve.loadgen", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speculative", default="server,none",
                   help="per-request setting: 'server' (the server's method and k), 'none', or a method name")
    args = p.parse_args(argv)
    for spec in args.speculative.split(","):
        for c in [int(x) for x in args.clients.split(",")]:
            print(json.dumps(asyncio.run(run(args.url, c, args.per_client, args.max_tokens, spec))), flush=True)


if __name__ == "__main__":
    main()
