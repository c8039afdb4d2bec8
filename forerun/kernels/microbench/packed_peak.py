"""The packed GGUF kernel's arithmetic rate with its weights in cache, by tokens per call.

    PYTHONPATH=. python forerun/kernels/microbench/packed_peak.py [--threads 1] [--tokens 1,2,4,8]

A decode step streams every weight once: at one token the kernel waits on memory, at k + 1
tokens it also has (k + 1) x the dot products to do. This times gguf_packed_rows on a Q4_K matrix
small enough to stay in L2 (1008 x 1536: 0.9 MB), so what it measures is the arithmetic alone:
multiply-accumulates per second (one VNNI instruction is 64 of them) and the bytes of Q4_K it
would get through at that rate. Where that rate, times the cores, is below the memory's, scoring
that many tokens costs more than streaming the weights once. A 16-row call is timed too and
taken off (the call's fixed cost: argument checks, quantizing the activations, threads).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from forerun.kernels import loader as kernel_loader
from forerun.linears.gguf import NATIVE_TYPES, Q4_K

BYTES_PER_WEIGHT = NATIVE_TYPES[Q4_K][1] / NATIVE_TYPES[Q4_K][0]  # a Q4_K block: 256 weights in 144 bytes


def seconds_per_call(kernel, rows: int, cols: int, tokens: int, calls: int = 300) -> float:
    """Median over 5 batches of `calls` calls of one [rows, cols] Q4_K matrix on `tokens` tokens."""
    g = torch.Generator().manual_seed(0)
    packed = kernel.gguf_pack(kernel.int4_fit_q4k(torch.randn(rows, cols, generator=g) * 0.05), Q4_K, cols)
    x, no_bias = torch.randn(tokens, cols, generator=g), torch.empty(0)
    for _ in range(20):
        kernel.gguf_packed_rows(x, [packed], [Q4_K], [rows], no_bias)
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            kernel.gguf_packed_rows(x, [packed], [Q4_K], [rows], no_bias)
        batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,2,4,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = kernel_loader.load()
    rows, cols = 1024, 1536
    print(f"packed Q4_K, {rows - 16} x {cols} in cache, {args.threads} thread(s), SIMD: {kernel.gguf_packed_isa()}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        t = seconds_per_call(kernel, rows, cols, tokens) - seconds_per_call(kernel, 16, cols, tokens)
        weights = (rows - 16) * cols
        print(f"{tokens:2d} tokens: {weights * tokens / t / 1e9:6.1f} G multiply-accumulates/s, "
              f"{weights * BYTES_PER_WEIGHT / t / 1e9:5.1f} GB/s of Q4_K")


if __name__ == "__main__":
    main()
