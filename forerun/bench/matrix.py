"""Issue 9's serving table in one command: `forerun serve` in each configuration, and
optionally llama.cpp's `llama-server` on the same GGUF, under 1, 4 and 8 concurrent clients.

    python -m forerun.bench.matrix --model smollm2-135m --method ngram --k 5 --clients 1,4,8 --out DIR

Each forerun configuration is its own server process (`python -m forerun.cli serve` on a free
loopback port, OMP_NUM_THREADS=--threads, --max-batch = the most clients):
  fixed        --method M --k K --no-batch-aware: every request drafts k
  batch-aware  --method M --k K: the server picks k <= K per batch size from measured tokens/s
  off          --method none: a server without speculation (no drafter loaded), plain decoding
llama-server runs once per configuration and concurrency N, with --parallel N slots
(bench/llama_peer.py: plain, and its counterpart of forerun's method).

Per server: each prompt the load will use is first run alone, one at a time (the greedy
reference, and a warm-up); then per concurrency, loadgen's clients (every request greedy,
streamed); KV blocks in use before the load, at its peak and once the server is idle again
(bench/matrix_cells.py). A request is identical when its text equals its prompt's text alone. Results go to
DIR/matrix.json (after every cell) and DIR/matrix.md; servers' logs to DIR/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import httpx

from forerun.bench.llama_peer import LlamaSetup, find_llama_server, llama_configs
from forerun.bench.matrix_cells import CONFIGS, forerun_cells, llama_cells
from forerun.bench.matrix_report import kv_text, label, markdown

NOTES = ("forerun off: a server started with --method none (no drafter). Identical: the request's text equals its "
         "prompt's text run alone on the same server. KV blocks: in use before the load / at its peak (/health "
         "every 0.25 s) / once idle after it, of the pool. llama-server: --parallel N for N clients, a context of "
         "--max-len per slot, cache_prompt false, on its GGUF's own quantised weights; forerun runs the weights "
         "converted from that GGUF at --dtype.")


class Report:
    """The cells so far, with the settings and servers' command lines: DIR/matrix.json and
    DIR/matrix.md are rewritten after every cell, so a long run that stops keeps what it measured."""

    def __init__(self, out: Path, title: str, settings: dict):
        self.out, self.title, self.settings = out, title, settings
        self.cells: list[dict] = []
        self.servers: list[dict] = []
        self.failures: list[str] = []

    def add(self, cell: dict) -> None:
        self.cells.append(cell)
        i = cell["identity"]
        print(f"{label(cell)}, {cell['clients']} clients: {cell['tok_per_s']:.1f} tok/s, p50 {cell['p50_s']:.2f} s, "
              f"p95 {cell['p95_s']:.2f} s, identical {i['same']}/{i['of']}, KV blocks (before / peak / after) "
              f"{kv_text(cell)}", file=sys.stderr, flush=True)
        self.write()

    def markdown(self) -> str:
        failed = "".join(f"- failed: {f}\n" for f in self.failures)
        return markdown(self.cells, self.title) + f"\n{NOTES}\n" + (f"\n{failed}" if failed else "")

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        body = {"title": self.title, "settings": self.settings, "servers": self.servers, "cells": self.cells,
                "failures": self.failures}
        (self.out / "matrix.json").write_text(json.dumps(body, indent=1) + "\n")
        (self.out / "matrix.md").write_text(self.markdown())


def llama_setup(args) -> LlamaSetup | None:
    """llama-server's setup when it is wanted and can run, else None (with a line saying why)."""
    from forerun.bench.commands import gguf_for

    binary = find_llama_server(args.llama_server)
    if binary is None:
        if args.llama_server:
            raise SystemExit(f"--llama-server {args.llama_server}: no llama-server binary there")
        print("matrix: no llama-server (pass --llama-server PATH or set $FORERUN_LLAMA_CPP_BIN): forerun only", file=sys.stderr)
        return None
    gguf = gguf_for(args.model)
    if gguf is None:
        print(f"matrix: {args.model} has no GGUF file (use an embedded name or a .gguf path): forerun only", file=sys.stderr)
        return None
    draft = gguf_for(args.draft_model) if args.draft_model and args.method == "draft_model" else None
    return LlamaSetup(binary, gguf, args.threads, args.max_len, args.k, draft, tuple(shlex.split(args.llama_args)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m forerun.bench.matrix", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="as forerun serve's --model; an embedded name or .gguf for llama-server")
    p.add_argument("--dtype", default="float32", help="forerun's verifier precision")
    p.add_argument("--method", default="ngram", help="forerun's drafter in the fixed and batch-aware servers")
    p.add_argument("--k", type=int, default=5, help="draft length (batch-aware: the longest); llama-server's too")
    p.add_argument("--draft-model", default=None, help="for --method draft_model; an embedded name or .gguf for llama-server")
    p.add_argument("--draft-dtype", default=None, help="the draft model's precision in forerun")
    p.add_argument("--configs", default=",".join(CONFIGS), help="forerun servers to run, of: " + ", ".join(CONFIGS))
    p.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (greedy)")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per sequence: forerun's --max-len, llama-server's context per slot")
    p.add_argument("--threads", type=int, default=2, help="forerun's OMP_NUM_THREADS, llama-server's -t / -tb")
    p.add_argument("--llama-server", default=None, help="llama-server binary or its folder (default: $FORERUN_LLAMA_CPP_BIN)")
    p.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    p.add_argument("--forerun-args", default="", help="more forerun serve flags, one string")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    p.add_argument("--out", type=Path, default=Path("serve-matrix"), help="folder for matrix.json, matrix.md, logs/")
    return p


def title(args) -> str:
    draft = f" drafted by {args.draft_model} ({args.draft_dtype or args.dtype})" if args.draft_model else ""
    return (f"{args.model} ({args.dtype}), {args.method} k={args.k}{draft}: {args.per_client} request(s) x "
            f"{args.max_tokens} tokens per client, {args.threads} threads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed flags, lists split: clients (ints), configs (forerun servers), forerun_args."""
    args = build_parser().parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    args.forerun_args = shlex.split(args.forerun_args)
    args.configs = [c for c in args.configs.split(",") if c]
    if unknown := set(args.configs) - set(CONFIGS):
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose among {', '.join(CONFIGS)}")
    if args.method == "none":  # nothing to speculate with: only the plain server
        args.configs = [c for c in args.configs if c == "off"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = Report(args.out, title(args), {**settings, "cpus": os.cpu_count(), "argv": sys.argv})
    setup = llama_setup(args)
    runs = [(forerun_cells, (c,)) for c in args.configs]
    runs += [(llama_cells, (setup, c)) for c in llama_configs(args.method, setup.draft_gguf is not None)] if setup else []
    for run, extra in runs:
        try:
            run(args, *extra, report)
        except (RuntimeError, httpx.HTTPError) as e:
            report.failures.append(f"{run.__name__.split('_')[0]} {extra[-1]}: {e}")
            print(f"matrix: {report.failures[-1]}", file=sys.stderr)
    report.write()
    print(report.markdown())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
