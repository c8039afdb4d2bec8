"""`forerun serve`'s parser and its serve-only flags (no imports: `forerun --help` stays light)."""


def register(sub, kit) -> None:
    """`serve` (cli_args.CommandKit): the shared model / sampling / drafter flags, then the server's."""
    v = sub.add_parser("serve", formatter_class=kit.fmt, help="OpenAI-compatible HTTP server: continuous batching + speculation")
    kit.add_common(v)
    add_arguments(v)
    v.set_defaults(handler=_serve)


def _serve(args) -> int:
    from forerun.serve.main import cmd_serve  # (imports fastapi and torch: only when serving)

    return cmd_serve(args)


def add_arguments(p) -> None:
    """The serve-only flags (the model and speculation flags come from cli_args.add_common)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-name", default=None, help="model id clients pass (default: the model folder's name)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (cache rows)")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + generated tokens per request (default: the model's context, or less where --kv-cache-gb "
                        "holds less)")
    p.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="memory for the KV block pool, taken as blocks are first used; when it runs out the newest "
                        "request waits (preempted) and resumes where it stopped")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: what --kv-cache-gb holds)")
    p.add_argument("--no-paged", action="store_true", help="K/V in rows of --max-len slots instead of the block pool")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before the server answers 429")
    p.add_argument("--no-batch-aware", action="store_true", help="keep each request's k whatever the batch size")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--no-prefix-cache", action="store_true",
                       help="no automatic prefix caching (default: on at gguf, int8, int4 and float32 on the kernels, "
                            "where a cache hit never changes a token)")
    cache.add_argument("--enable-prefix-caching", action="store_true",
                       help="prefix caching at any precision: at bfloat16, float32 without the kernels or on another "
                            "device a hit may change tokens (their prefill and decoding round differently)")
    p.add_argument("--prefix-cache-gb", type=float, default=1.0, help="memory the prefix cache's KV blocks may hold")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens computed between two decoding steps, at most (0: whole prompts at admission)")
    p.add_argument("--prefill-chunk-seconds", type=float, default=0.5,
                   help="while other streams run, size each chunk by the measured prefill rate to take about this long "
                        "(0: always --prefill-chunk tokens)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' on /v1 (repeatable; also FORERUN_API_KEY); each "
                        "key is a tenant: its cached prefixes and suffix-decoding history serve its own requests only")
    p.add_argument("--api-key-file", action="append", default=None, metavar="FILE",
                   help="API keys, one per line (# comments), as --api-key")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    # a request without max_tokens may use the rest of the context, as in vLLM (cut at 128, tool calls end mid-JSON)
    p.set_defaults(max_new_tokens=None)
