"""Several forerun servers behind one endpoint, on Ray Serve: each replica is a whole
`forerun serve` app (its own model, scheduler and KV cache); Ray's proxy spreads requests
over the replicas and streams their SSE responses through.

    pip install "ray[serve]"
    python -m forerun.serve.ray_app --replicas 2 --port 8000 --method ngram --k 5

Requests are routed per request, so continuous batching happens inside each replica; a
replica gets `--threads` torch threads (set it to the cores you give each replica). It starts a
local Ray cluster of its own, and Ctrl-C (or SIGTERM) stops the replicas and that cluster; with
RAY_ADDRESS set it joins that cluster instead and leaves it running.
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from typing import Callable


def build_replica_app(make_llm: Callable, method: str | None, k: int, max_batch: int, max_len: int,
                      names: tuple[str, ...], threads: int):
    """Runs inside each replica: the model, its scheduler and the FastAPI app."""
    import torch

    from forerun.config import SpeculativeConfig
    from forerun.serve.main import build_server
    from forerun.serve.scheduler import ServeConfig

    torch.set_num_threads(threads)
    spec = SpeculativeConfig(method, k) if method and k else None
    return build_server(make_llm(), spec, ServeConfig(max_batch=max_batch, max_len=max_len), names=names)


def embedded_llm(model: str | None = None, dtype: str = "float32"):
    from forerun.llm import LLM

    return LLM(model=model, dtype=dtype, progress=False)


def application(make_llm: Callable = embedded_llm, replicas: int = 2, method: str | None = "ngram", k: int = 5,
                max_batch: int = 8, max_len: int = 2048, names: tuple[str, ...] = (), threads: int = 1):
    """A Ray Serve application of `replicas` forerun servers (pass it to serve.run)."""
    from ray import serve

    def builder():  # a plain function: Ray calls it in each replica (a partial would be taken for an ASGI app)
        return build_replica_app(make_llm, method, k, max_batch, max_len, names, threads)

    cls = serve.ingress(builder)()
    return serve.deployment(cls, name="forerun", num_replicas=replicas, ray_actor_options={"num_cpus": threads}).bind()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m forerun.serve.ray_app", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (and Ray CPUs) per replica")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default="ngram", help="drafter, or none")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2048)
    args = p.parse_args(argv)
    import ray
    from ray import serve

    joined = os.environ.get("RAY_ADDRESS")  # a cluster someone else runs: leave it running
    ray.init(address=joined or "local")  # else a local cluster of this process's own, stopped below
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # `kill` stops it as Ctrl-C does: through finally
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        make_llm = functools.partial(embedded_llm, args.model, args.dtype)
        method = None if args.method == "none" else args.method
        serve.run(application(make_llm, args.replicas, method, args.k, args.max_batch, args.max_len, threads=args.threads),
                  blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        print("forerun: stopping the replicas" + ("" if joined else " and the local Ray cluster"), file=sys.stderr, flush=True)
        try:
            if joined:
                serve.delete("default")  # our application only: the cluster and its Serve are someone else's
            else:
                serve.shutdown()  # the replicas and the proxy (detached actors: they outlive a driver otherwise)
        finally:
            ray.shutdown()  # our own cluster: raylet, gcs_server and the workers stop with it (joined: disconnects)


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
