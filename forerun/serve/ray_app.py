"""Several forerun servers behind one endpoint, on Ray Serve: each replica is a whole
`forerun serve` app (its own model, scheduler and KV cache); Ray's proxy spreads requests
over the replicas and streams their SSE responses through.

    pip install "ray[serve]"
    python -m forerun.serve.ray_app --replicas 2 --port 8000 --method ngram --k 5

It takes every `forerun serve` option, with the same defaults (its parser is built by the same
functions), plus `--replicas` and `--threads`. Requests are routed per request, so continuous
batching happens inside each replica; a replica gets `--threads` torch threads (set it to the
cores you give each replica). It starts a local Ray cluster of its own, and Ctrl-C (or SIGTERM)
stops the replicas and that cluster; with RAY_ADDRESS set it joins that cluster instead and
leaves it running.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

PROG = "python -m forerun.serve.ray_app"
# uvicorn's levels (serve's --log-level) as Python's logging names them, for the replicas' logs.
LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG", "trace": "DEBUG"}


def build_parser() -> argparse.ArgumentParser:
    """`forerun serve`'s options, added by the two functions its own parser is built with, + --replicas, --threads."""
    from forerun.cli_args import HelpFormatter, Parser, add_common
    from forerun.serve.flags import add_arguments

    p = Parser(prog=PROG, description="forerun serve's app in each of several Ray Serve replicas, behind one endpoint.",
               formatter_class=HelpFormatter)
    add_common(p)
    add_arguments(p)
    p.add_argument("--replicas", type=int, default=2, help="forerun servers behind the endpoint, each with its own model")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and Ray CPUs) per replica")
    return p


def build_replica_app(args: argparse.Namespace):
    """Runs inside each replica: the model, its scheduler and the FastAPI app, as `forerun serve` builds them."""
    import torch

    from forerun.cli_args import configs, load_llm
    from forerun.serve.main import server_from_args

    torch.set_num_threads(args.threads)
    _, spec = configs(args)
    llm = load_llm(args, spec, prefix_cache=None)
    app = server_from_args(args, llm, spec)
    print(f"forerun replica: {app.state.limits.model_names[0]} ({llm.dtype}), method {app.state.limits.method or 'none'} "
          f"k={app.state.limits.k_max}, {args.threads} thread(s)", file=sys.stderr, flush=True)
    return app


def application(args: argparse.Namespace):
    """A Ray Serve application of `args.replicas` forerun servers (pass it to serve.run); `args` from build_parser."""
    from ray import serve

    def builder():  # a plain function: Ray calls it in each replica (a partial would be taken for an ASGI app)
        return build_replica_app(args)

    cls = serve.ingress(builder)()
    return serve.deployment(cls, name="forerun", num_replicas=args.replicas, ray_actor_options={"num_cpus": args.threads},
                            logging_config={"log_level": LOG_LEVELS.get(args.log_level.lower(), "WARNING")}).bind()


def fetch_models(args: argparse.Namespace) -> None:
    """Download (or convert) --model and draft_model's --draft-model here, once: the replicas of a
    local cluster share this machine's cache, and would otherwise all fetch them at the same time."""
    from forerun.models.loader import resolve_model_dir

    resolve_model_dir(args.model)
    if args.method == "draft_model" and args.draft_model:
        resolve_model_dir(args.draft_model)


def main(argv: list[str] | None = None) -> None:
    from forerun.cli_args import configs, in_flags
    from forerun.errors import ForerunError

    parser = build_parser()
    args = parser.parse_args(argv)
    joined = os.environ.get("RAY_ADDRESS")  # a cluster someone else runs: leave it running
    try:
        configs(args)  # a bad drafter option fails here, in one line, not in every replica
        if not joined:
            fetch_models(args)
    except ForerunError as e:
        parser.exit(2, f"{PROG}: error: {in_flags(str(e), parser)}\n")
    import ray
    from ray import serve

    ray.init(address=joined or "local")  # else a local cluster of this process's own, stopped below
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # `kill` stops it as Ctrl-C does: through finally
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(args), blocking=True)
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
