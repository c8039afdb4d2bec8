"""How close a forward on a few tokens comes to streaming its weights from memory once.

    PYTHONPATH=. python scripts/stream_rate.py [--model qwen2.5-coder-0.5b] [--dtype int4] [--tokens 1] [--rounds 4]

A one-token forward has little arithmetic to do: it is fast when its kernels read their weights
as fast as the memory delivers them. This alternates, in one process, (1) the layers' four
compiled linears per layer on T tokens (the forward's weight traffic, nothing else), (2) the whole
compiled layer stack (attention, silu, residuals and the glue between kernels added), and
(3) `torch.sum` on both cores over a float32 buffer of 1 GiB (the memory's streaming rate, read
past the 32 MiB L3; a buffer of the layers' own size can be partly served from it). The
machine's memory speed drifts within minutes: compare the three within a round.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from forerun import LLM
from forerun.kv.cache import KVCache, chain_batch


def weight_bytes(linear) -> int:
    """Bytes the linear's kernel reads, the tensors its KernelLinear is bound to: a GGUFLinear's
    parts, an Int4Linear's packed values with their scales and minimums, an Int8Linear's packed
    weight and scales."""
    if hasattr(linear, "parts"):
        return sum(p.data.nbytes for p in linear.parts)
    if hasattr(linear, "_packed"):
        return sum(t.nbytes for t in linear._packed)
    return linear.weight_packed.nbytes + linear.weight_scale.nbytes


def median_ms(f, repeats: int) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="int4", help="int8, int4 or gguf: the precisions with compiled layers")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(2)
    m = LLM(args.model, dtype=args.dtype, progress=False).model
    c = m.config
    if getattr(m.backend, "stack", None) is None:
        raise SystemExit(f"{args.model} at {args.dtype} has no compiled layer stack (int8, int4 or gguf with the kernels built)")
    layers = m.model.layers
    modules = [(l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj) for l in layers]
    kernels = [layer.bound_linears() for layer in layers]
    nbytes = sum(weight_bytes(q) for four in modules for q in four)
    T, C, I = args.tokens, c.hidden_size, c.intermediate_size
    xs, xi = torch.randn(1, T, C), torch.randn(1, T, I)
    big = torch.ones(2**28)  # 1 GiB of float32
    cache = KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, 1024, c.hidden_size // c.num_attention_heads,
                    torch.float32, torch.device("cpu"))
    ids = list(range(1000, 1300))

    def linears():
        for qkv, o, gate_up, down in kernels:
            qkv(xs), o(xs), gate_up(xs), down(xi)

    with torch.inference_mode():
        m.forward(chain_batch([ids], [0], [0], torch.device("cpu")), cache, logits_at=None)  # 300 tokens of context
        b = chain_batch([ids[:T]], [300], [0], torch.device("cpu"))
        x = m.model.embed_tokens(b.tokens)
        cos, sin = m._rope(b.positions, x.dtype)
        stack = lambda: m.backend.stack(x, cos, sin, cache.k, cache.v, b.row_index, b.slots)  # noqa: E731
        print(f"{args.model} at {args.dtype}, {T} token(s): the layers' linears read {nbytes / 1e6:.0f} MB")
        for r in range(args.rounds):
            lin, stk = median_ms(linears, args.repeats), median_ms(stack, args.repeats)
            mem = median_ms(lambda: big.sum(), max(5, args.repeats // 10))
            rate = big.nbytes / mem / 1e6
            print(f"round {r + 1}: linears {lin:.2f} ms ({nbytes / lin / 1e6:.0f} GB/s), layer stack {stk:.2f} ms, "
                  f"sum over 1 GiB {rate:.0f} GB/s (the linears' bytes in {nbytes / rate / 1e6:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
