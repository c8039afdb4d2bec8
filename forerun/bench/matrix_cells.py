"""The cells of the serve matrix (bench/matrix.py): a server per configuration, the greedy
reference (each prompt alone), and one measured load per concurrency.

A cell: loadgen's summary of the load, identity against the reference, acceptance = accepted /
drafted tokens during the load (forerun: /metrics counters; llama-server: each response's
`timings`), and for forerun the KV blocks in use (/metrics) before the load, at its peak
(/health polled every 0.25 s) and once the server is idle again.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import httpx

from forerun.bench import loadgen
from forerun.bench.launch import Launched, free_port
from forerun.bench.llama_peer import LlamaSetup, llama_argv
from forerun.bench.matrix_report import identity

CONFIGS = ("fixed", "batch-aware", "off")
LLAMA_BODY = {"cache_prompt": False}  # forerun reuses no prompt prefix; neither may llama-server


def prom_values(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text exposition.

    >>> prom_values("# HELP x y\\nforerun_kv_blocks_used 3.0\\nforerun_requests_total{outcome=\\"stop\\"} 2.0\\n")
    {'forerun_kv_blocks_used': 3.0}
    """
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def server_state(url: str) -> dict[str, float]:
    return prom_values(httpx.get(url + "/metrics", timeout=30).text)


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until /health shows nothing running or waiting (a finished stream's row is released
    by the engine thread, a moment after its last event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health", timeout=30).json()
        if not h["running"] and not h["waiting"]:
            return
        time.sleep(0.1)


def forerun_argv(args, config: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "forerun.cli", "serve", "--model", args.model, "--dtype", args.dtype,
            "--port", str(port), "--max-batch", str(max(args.clients)), "--max-len", str(args.max_len)]
    if config == "off":
        return argv + ["--method", "none"] + args.forerun_args
    argv += ["--method", args.method, "--k", str(args.k)]
    argv += ["--draft-model", args.draft_model] if args.draft_model else []
    argv += ["--draft-dtype", args.draft_dtype] if args.draft_dtype else []
    return argv + (["--no-batch-aware"] if config == "fixed" else []) + args.forerun_args


def forerun_label(args, config: str) -> str:
    return {"fixed": f"fixed k={args.k}", "batch-aware": f"batch-aware k<={args.k}", "off": "off"}[config]


def prompts_used(args) -> int:
    """How many of loadgen's prompts the largest load sends (client i's j-th is (i + j) % n)."""
    return min(len(loadgen.PROMPTS), max(args.clients) + args.per_client - 1)


def alone_texts(url: str, args, extra: dict) -> dict[int, str]:
    records, _ = asyncio.run(loadgen.run(url, 1, prompts_used(args), args.max_tokens, extra))
    return {r["prompt"]: r["text"] for r in records}


async def load_with_peak(url: str, clients: int, args, extra: dict, poll: bool) -> tuple[list[dict], float, int | None]:
    """loadgen's run, and (poll) the most KV blocks /health showed in use while it ran."""
    peak = None

    async def sample() -> None:
        nonlocal peak
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while True:
                peak = max(peak or 0, (await c.get("/health")).json()["kv_blocks_used"])
                await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample()) if poll else None
    try:
        records, wall = await loadgen.run(url, clients, args.per_client, args.max_tokens, extra)
    finally:
        if sampler:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    return records, wall, peak


def measure(url: str, clients: int, args, alone: dict[int, str], extra: dict, forerun: bool) -> dict:
    """One cell: the load at `clients`, its summary, identity and (forerun) KV blocks / acceptance."""
    before = server_state(url) if forerun else {}
    load_before = os.getloadavg()[0]
    records, wall, peak = asyncio.run(load_with_peak(url, clients, args, extra, poll=forerun))
    cell = {"clients": clients, **loadgen.summarize(records, wall), "identity": identity(records, alone),
            "loadavg_before": round(load_before, 2), "loadavg_after": round(os.getloadavg()[0], 2),
            "kv_before": None, "kv_peak": peak, "kv_after": None, "kv_total": None, "acceptance": None}
    drafted = sum(r["drafted"] or 0 for r in records)  # llama-server's own count (timings)
    if drafted:
        cell["acceptance"] = sum(r["accepted"] or 0 for r in records) / drafted
    if forerun:
        wait_idle(url)
        after = server_state(url)
        drafted = after["forerun_drafted_tokens_total"] - before["forerun_drafted_tokens_total"]
        accepted = after["forerun_accepted_tokens_total"] - before["forerun_accepted_tokens_total"]
        cell.update(kv_before=int(before["forerun_kv_blocks_used"]), kv_after=int(after["forerun_kv_blocks_used"]),
                    kv_total=int(after["forerun_kv_blocks_total"]), acceptance=accepted / drafted if drafted else None)
        health = httpx.get(url + "/health", timeout=30).json()  # batch-aware k's table so far (None when off)
        cell.update(batch_k_tokens_per_s=health.get("batch_k_tokens_per_s"), batch_k_steps=health.get("batch_k_steps"))
    return cell


def forerun_cells(args, config: str, report) -> None:
    port = free_port()
    argv = forerun_argv(args, config, port)
    report.servers.append({"engine": "forerun", "config": config, "argv": argv})
    env = {"OMP_NUM_THREADS": str(args.threads)}
    with Launched(argv, port, args.out / "logs" / f"forerun-{config}.log", env, args.startup_timeout) as url:
        alone = alone_texts(url, args, {})
        for n in args.clients:
            report.add({"engine": "forerun", "config": forerun_label(args, config),
                        **measure(url, n, args, alone, {}, forerun=True)})


def llama_cells(args, setup: LlamaSetup, config: str, report) -> None:
    name = {"plain": "plain", "draft": f"draft k={args.k}", "ngram": f"ngram-simple k={args.k}"}[config]
    for n in args.clients:
        port = free_port()
        argv = llama_argv(setup, config, n, port)
        report.servers.append({"engine": "llama-server", "config": config, "clients": n, "argv": argv})
        with Launched(argv, port, args.out / "logs" / f"llama-{config}-{n}.log", timeout=args.startup_timeout) as url:
            alone = alone_texts(url, args, LLAMA_BODY)
            report.add({"engine": "llama-server", "config": name, **measure(url, n, args, alone, LLAMA_BODY, forerun=False)})

