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

from forerun.serve.replica import build_replica_app  # noqa: F401  (each replica's app; ray_routing's Replica too)

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
    p.add_argument("--routing", choices=["prefix", "random"], default="prefix",
                   help="prefix: a request goes to the replica holding its prefix (prompt_cache_key, else a hash of its "
                        "start), so a session's turns hit its prefix cache; random: Ray's default (power of two choices)")
    return p


def application(args: argparse.Namespace):
    """A Ray Serve application of `args.replicas` forerun servers (pass it to serve.run); `args` from build_parser.
    --routing prefix puts a front deployment before them that routes by prefix (serve/ray_routing.py)."""
    from ray import serve

    logging = {"log_level": LOG_LEVELS.get(args.log_level.lower(), "WARNING")}
    if getattr(args, "routing", "prefix") == "prefix":
        from ray.serve.config import RequestRouterConfig

        from forerun.serve.ray_routing import Front, PrefixRouter, Replica

        replicas = serve.deployment(Replica, name="forerun", num_replicas=args.replicas, logging_config=logging,
                                    ray_actor_options={"num_cpus": args.threads},
                                    request_router_config=RequestRouterConfig(request_router_class=PrefixRouter)).bind(args)
        return serve.deployment(Front, name="front", ray_actor_options={"num_cpus": 0}, logging_config=logging).bind(replicas)

    def builder():  # a plain function: Ray calls it in each replica (a partial would be taken for an ASGI app)
        return build_replica_app(args)

    cls = serve.ingress(builder)()
    return serve.deployment(cls, name="forerun", num_replicas=args.replicas, ray_actor_options={"num_cpus": args.threads},
                            logging_config=logging).bind()


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
