"""Load: many concurrent streaming clients on loopback for a bounded time. Every stream
completes with [DONE], greedy texts equal the same prompts served alone, the batch really
was shared, and afterwards no KV block or row is held."""
import asyncio
import json
import time

import httpx

from tests.serve_util import tiny_server, wait_idle

CLIENTS = 16
SECONDS = 6.0  # each client keeps sending requests until this has passed


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish, lines = [], None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line[6:])["choices"][0]
        text.append(choice["text"])
        finish = choice["finish_reason"] or finish
    return "".join(text), finish


async def client_loop(url: str, i: int, until: float, results: list):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        n = 0
        while time.time() < until:
            prompt = f"{i % 5}{i % 3}" * (1 + n % 4)
            results.append((prompt, 8 + 4 * (i % 4), await stream_one(client, prompt, 8 + 4 * (i % 4))))
            n += 1


def test_many_concurrent_streaming_clients():
    with tiny_server(k=3, max_batch=6, max_queue=CLIENTS) as s:
        results: list = []
        until = time.time() + SECONDS

        async def main():
            await asyncio.gather(*[client_loop(s.url, i, until, results) for i in range(CLIENTS)])

        asyncio.run(asyncio.wait_for(main(), timeout=SECONDS + 30))
        assert len(results) >= CLIENTS
        with s.client() as c:
            for prompt, max_tokens in {(p, m) for p, m, _ in results}:
                alone = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).json()
                expected = (alone["choices"][0]["text"], alone["choices"][0]["finish_reason"])
                assert all(out == expected for p, m, out in results if (p, m) == (prompt, max_tokens))
            metrics = c.get("/metrics").text
        wait_idle(s.scheduler)
        assert s.scheduler.blocks.used == 0 and not s.scheduler.running
        assert 'forerun_requests_total{outcome="length"}' in metrics
        sizes = s.app.state.metrics._row_steps / s.app.state.metrics.steps._value.get()
        assert sizes > 1.5, f"mean batch size {sizes}: requests were not batched together"
