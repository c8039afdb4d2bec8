"""`forerun distill`: the verifier answers chat requests built from allowed text
(train/instructions.py), in batches, and each conversation is written as one JSONL row that
`forerun train --data FILE` reads: {"text": the chat-templated request + answer, "prompt",
"response"}. Training on "text" puts the verifier's hidden states over its own answers,
in the context it answers in, under the head: the text the head will draft in serving.

Rows are appended a batch at a time and a rerun continues after the rows already there
(same sources, seed and count give the same requests), so Ctrl-C loses one batch at most.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from forerun.errors import ConfigError


def register(sub, kit) -> None:
    """`distill` (cli_args.CommandKit)."""
    d = sub.add_parser("distill", formatter_class=kit.fmt,
                       help="self-distillation data: the verifier answers requests built from --data (JSONL for `forerun train`)")
    d.add_argument("--model", default=None, help="the verifier (model folder, .gguf, hub id or embedded name)")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int8", "int4"),
                   help="the verifier's precision while answering")
    d.add_argument("--data", action="append", default=[], required=True,
                   help="request sources, repeatable: a file, a folder or pkg:NAME (as `forerun train --data`)")
    d.add_argument("--out", required=True, help="JSONL file the conversations are appended to")
    d.add_argument("--count", type=int, default=256, help="conversations in the file when done")
    d.add_argument("--batch", type=int, default=8, help="requests answered together")
    d.add_argument("--max-new-tokens", type=int, default=192, help="tokens per answer at most")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = the verifier's greedy answers")
    d.add_argument("--math-share", type=float, default=0.15, help="share of arithmetic word problems")
    d.add_argument("--general-share", type=float, default=0.25, help="share of everyday requests (stories, tips, emails) over a fixed topic list")
    d.add_argument("--seed", type=int, default=0, help="seed for the requests and the sampling")
    d.add_argument("--max-minutes", type=float, default=None, help="stop after this long (rerun to continue)")
    d.set_defaults(handler=cmd_distill)


def done_rows(path: Path) -> int:
    """Rows already in the file (a torn last line from a killed run is dropped)."""
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    good = []
    for line in lines:
        try:
            json.loads(line)
            good.append(line)
        except json.JSONDecodeError:
            break
    if len(good) != len(lines):
        path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
    return len(good)


def distill(llm, asks: list[str], out: Path, params, batch: int, max_minutes: float | None = None, progress=None) -> int:
    """Append one row per request to `out`, answered `batch` at a time; returns the tokens
    generated. Stops early (after a whole batch) once max_minutes have passed."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(asks), batch):
        chunk = asks[i : i + batch]
        prompts = [llm.apply_chat_template([{"role": "user", "content": a}]) for a in chunk]
        outs = llm.generate(prompts, params, speculative=None)
        with out.open("a", encoding="utf-8") as f:
            for ask, prompt, o in zip(chunk, prompts, outs):
                f.write(json.dumps({"text": prompt + o.text, "prompt": ask, "response": o.text}) + "\n")
        tokens += sum(len(o.token_ids) for o in outs)
        if progress is not None:
            progress(len(chunk), tokens / (time.perf_counter() - start))
        if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
            print(f"stopped after {max_minutes} min; rerun the same command to continue", file=sys.stderr)
            break
    return tokens


def cmd_distill(args) -> int:
    from tqdm import tqdm

    from forerun.config import SamplingParams
    from forerun.llm import LLM
    from forerun.train.instructions import requests

    if args.count < 1 or args.batch < 1 or args.max_new_tokens < 1:
        raise ConfigError("--count, --batch and --max-new-tokens must be >= 1")
    if not (0.0 <= args.math_share and 0.0 <= args.general_share and args.math_share + args.general_share <= 1.0):
        raise ConfigError(f"--math-share and --general-share must be >= 0 and sum to at most 1, got {args.math_share} and {args.general_share}")
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = requests(args.data, args.count, args.seed, args.math_share, args.general_share)[done_rows(out):]
    if not todo:
        print(f"{out}: already holds {args.count} conversations", file=sys.stderr)
        return 0
    llm = LLM(model=args.model, dtype=args.dtype, speculative=None)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    with tqdm(total=args.count, initial=args.count - len(todo), desc="distill", unit="answer", file=sys.stderr) as bar:
        def progress(n, tok_s):
            bar.update(n)
            bar.set_postfix(tok_s=f"{tok_s:.1f}")

        distill(llm, todo, out, params, args.batch, args.max_minutes, progress)
    print(f"{out}: {done_rows(out)} conversations (train on them with --data {out})", file=sys.stderr)
    return 0
