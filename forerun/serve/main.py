"""Assemble a server (`build_server`) and run it (`forerun serve`)."""
from __future__ import annotations

import socket
import sys

from forerun.config import SpeculativeConfig
from forerun.errors import ForerunError
from forerun.serve.admission import Limits
from forerun.serve.auth import ApiKeys
from forerun.serve.one_pool import built_off_thread
from forerun.serve.scheduler import Scheduler, ServeConfig, budget_blocks


def build_server(llm, spec: SpeculativeConfig | None, cfg: ServeConfig = ServeConfig(),
                 default_max_tokens: int | None = 128, names: tuple[str, ...] = (), keys: ApiKeys = ApiKeys()):
    """The FastAPI app for `llm` (its scheduler starts with the app's lifespan); with `keys`,
    the /v1 routes need one of them (serve/auth.py). default_max_tokens: a request's when it
    names none (None: the rest of the context, `forerun serve`'s default)."""
    from forerun.serve.app import build_app
    from forerun.serve.metrics import ServeMetrics

    if spec is not None and spec.adaptive:  # the server picks k per batch itself (batch_k)
        spec = SpeculativeConfig(**{**spec.__dict__, "num_speculative_tokens": spec.k_max, "options": {}})
    metrics = ServeMetrics()
    sched = Scheduler(llm, spec, cfg, metrics)
    names = tuple(dict.fromkeys(names or (llm.name,)))  # the first is the id responses carry
    limits = Limits(names, sched.max_len, default_max_tokens, sched.spec.method if sched.spec else None, sched.k_max)
    return build_app(llm, sched, limits, metrics, keys)


def cmd_serve(args) -> int:
    import uvicorn

    from forerun.bench.fidelity import line_for
    from forerun.cli_args import configs, load_llm

    _, spec = configs(args)
    sock = reserve_port(args.host, args.port)  # a port in use fails now, not after the model loads
    app = built_off_thread(lambda: server_from_args(args, load_llm(args, spec, prefix_cache=prefix_choice(args)), spec))
    st, llm = app.state, app.state.llm
    sch = st.scheduler
    print(f"forerun serve: {st.limits.model_names[0]} ({llm.dtype}), method {st.limits.method or 'none'} k={st.limits.k_max}, "
          f"{args.max_batch} rows, up to {st.limits.max_len} tokens a request, http://{args.host}:{args.port}/v1", file=sys.stderr)
    pool_gb, budget = sch.blocks.num_blocks * sch.block_bytes / 2**30, budget_blocks(sch.cfg, sch.block_bytes)
    why = ("--num-blocks" if args.num_blocks else f"--kv-cache-gb {args.kv_cache_gb:g}" if sch.blocks.num_blocks >= budget
           else f"every row at the longest request, within --kv-cache-gb {args.kv_cache_gb:g}")
    print(f"forerun serve: KV pool {pool_gb:.2f} GiB ({why}): {sch.blocks.num_blocks} blocks of {args.block_size} tokens = "
          f"{sch.blocks.num_blocks * args.block_size} tokens ({llm.model.kv_dtype}), taken as used; when they run out the "
          f"newest request waits and resumes", file=sys.stderr)
    print(f"forerun serve: {line_for(llm, args.model)}", file=sys.stderr)
    if st.keys.enabled:
        print(f"forerun serve: /v1 needs one of {len(st.keys.digests)} API key(s); each key is a tenant", file=sys.stderr)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run(sockets=[sock])
    return 0


def server_from_args(args, llm, spec: SpeculativeConfig):
    """`build_server` for `llm` as `forerun serve`'s flags say (`spec` from cli_args.configs); each
    replica of `python -m forerun.serve.ray_app` builds its app with it too."""
    cfg = ServeConfig(max_batch=args.max_batch, max_len=args.max_len, block_size=args.block_size,
                      num_blocks=args.num_blocks, kv_cache_gb=args.kv_cache_gb, paged=not args.no_paged, max_queue=args.max_queue,
                      batch_aware=not args.no_batch_aware, prefix_cache=prefix_choice(args),
                      prefix_cache_gb=args.prefix_cache_gb, prefill_chunk=args.prefill_chunk or None,
                      prefill_chunk_seconds=args.prefill_chunk_seconds or None)
    names = tuple(n for n in (args.served_name, llm.name, args.model) if n)
    keys = ApiKeys.of(args.api_key or (), args.api_key_file or ())
    return build_server(llm, spec if spec.enabled else None, cfg, args.max_new_tokens, names, keys)


def prefix_choice(args) -> bool | None:
    """ServeConfig.prefix_cache from the flags: False (--no-prefix-cache), True
    (--enable-prefix-caching), None (on where a hit never changes a token). The LLM is built
    with the same choice, so the draft model's own pool follows it."""
    return False if args.no_prefix_cache else True if getattr(args, "enable_prefix_caching", False) else None


def reserve_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything slow happens; uvicorn listens on it."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ForerunError(f"--host {host}: not an address to listen on ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a closed server's port is free
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ForerunError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                           "another server is there? choose another --port") from None
    return sock
