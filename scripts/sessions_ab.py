"""Agent sessions (forerun.bench.sessions) against forerun servers built from different source
trees, alternated turn by turn in one run: an A/B of two commits on the workload itself.

    git worktree add /tmp/before <commit>
    python scripts/sessions_ab.py --tree before=/tmp/before --tree after=. --sessions 2 \\
        --options "--model qwen2.5-coder-1.5b --dtype gguf --method suffix --k 8"

Each tree serves with PYTHONPATH at it (the same Python environment and options); both trees
must need the same compiled kernels (or build their own at run time). Prints each session's line
and each tree's summary as the bench does (forerun.bench.sessions.play_all).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from forerun.bench.launch import server_argvs
from forerun.bench.sessions import build_sessions, play_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH: a forerun source tree (repeatable)")
    p.add_argument("--options", required=True, help="`forerun serve` options, the same for every tree")
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--out", default="forerun-runs/sessions_ab")
    args = p.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    if any(len(t) != 2 or not (Path(t[1]) / "forerun").is_dir() for t in trees):
        raise SystemExit("--tree takes NAME=PATH, PATH a source tree holding forerun/")
    (_, serve), = server_argvs([args.options], args.max_len)  # the bench's own `forerun serve` command
    servers = [(name, ["env", f"PYTHONPATH={Path(path).resolve()}", *serve]) for name, path in trees]
    play_all(servers, build_sessions(args.sessions, args.turns), args.max_tokens, args.out)


if __name__ == "__main__":
    main()
