"""Assemble a server (`build_server`) and run it (`forerun serve`)."""
from __future__ import annotations

import sys

from forerun.config import SpeculativeConfig
from forerun.serve.admission import Limits
from forerun.serve.scheduler import Scheduler, ServeConfig


def build_server(llm, spec: SpeculativeConfig | None, cfg: ServeConfig = ServeConfig(),
                 default_max_tokens: int = 128, names: tuple[str, ...] = ()):
    """The FastAPI app for `llm` (its scheduler starts with the app's lifespan)."""
    from forerun.serve.app import build_app
    from forerun.serve.metrics import ServeMetrics

    if spec is not None and spec.adaptive:  # the server picks k per batch itself (batch_k)
        spec = SpeculativeConfig(**{**spec.__dict__, "num_speculative_tokens": spec.k_max, "options": {}})
    cfg = ServeConfig(**{**cfg.__dict__, "max_len": min(cfg.max_len, llm.max_context)})
    metrics = ServeMetrics()
    sched = Scheduler(llm, spec, cfg, metrics)
    names = tuple(dict.fromkeys(names or (llm.name,)))  # the first is the id responses carry
    limits = Limits(names, cfg.max_len, default_max_tokens, sched.spec.method if sched.spec else None, sched.k_max)
    return build_app(llm, sched, limits, metrics)


def cmd_serve(args) -> int:
    import uvicorn

    from forerun.cli import _configs, _llm

    _, spec = _configs(args)
    llm = _llm(args, spec)
    cfg = ServeConfig(max_batch=args.max_batch, max_len=args.max_len, block_size=args.block_size,
                      num_blocks=args.num_blocks, paged=not args.no_paged, max_queue=args.max_queue,
                      batch_aware=not args.no_batch_aware)
    names = tuple(n for n in (args.served_name, llm.name, args.model) if n)
    app = build_server(llm, spec if spec.enabled else None, cfg, args.max_new_tokens, names)
    st = app.state
    print(f"forerun serve: {st.limits.model_names[0]} ({args.dtype}), method {st.limits.method or 'none'} k={st.limits.k_max}, "
          f"{cfg.max_batch} rows x {st.limits.max_len} tokens, {st.scheduler.blocks.num_blocks} KV blocks of {cfg.block_size}, "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
