"""What each Ray Serve replica runs: the model, its scheduler and the FastAPI app, built as
`forerun serve` builds them (serve/ray_app.py's ingress replicas and ray_routing.Replica)."""
from __future__ import annotations

import argparse
import sys


def build_replica_app(args: argparse.Namespace):
    """Runs inside each replica: the model, its scheduler and the FastAPI app, as `forerun serve` builds them."""
    import torch

    from forerun.cli_args import configs, load_llm
    from forerun.serve.main import prefix_choice, server_from_args

    from forerun.serve.one_pool import built_off_thread

    torch.set_num_threads(args.threads)  # (torch hands it to every thread that starts parallel work)
    _, spec = configs(args)
    app = built_off_thread(lambda: server_from_args(args, load_llm(args, spec, prefix_cache=prefix_choice(args)), spec))
    llm = app.state.llm
    print(f"forerun replica: {app.state.limits.model_names[0]} ({llm.dtype}), method {app.state.limits.method or 'none'} "
          f"k={app.state.limits.k_max}, {args.threads} thread(s)", file=sys.stderr, flush=True)
    return app
