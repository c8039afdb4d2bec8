"""Prefix routing against random routing behind `python -m forerun.serve.ray_app`: concurrent agent
sessions (forerun.bench.sessions' stdlib-built sessions) against N replicas, once per routing;
prints per routing the share of later turns' prompt tokens the replicas found cached and the mean
session time.

    .venv/bin/python scripts/ray_routing.py --replicas 2 --sessions 4 --turns 3 --max-tokens 48 \\
        -- --max-batch 4 --max-len 4096              # (after --: more ray_app / serve options)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from forerun.bench.launch import Launched, free_port
from forerun.bench.sessions import build_sessions, play


def distinct_sessions(n: int, turns: int, file_chars: int) -> list:
    """n sessions: the standard library's few that qualify, repeated with a session number at the
    start of their system prompt (each one its own prefix, as different users' sessions are)."""
    base = build_sessions(2, turns, file_chars=file_chars)
    out = []
    for i in range(n):
        s = base[i % len(base)]
        opening = [{**s.opening[0], "content": f"Session {i}. " + s.opening[0]["content"]}, *s.opening[1:]]
        out.append(dataclasses.replace(s, opening=opening))
    return out


def run(routing: str, args, extra: list[str], out: Path) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "forerun.serve.ray_app", "--replicas", str(args.replicas), "--threads", "1",
            "--routing", routing, "--port", str(port), *extra]
    sessions = distinct_sessions(args.sessions, args.turns, args.file_chars)
    with Launched(argv, port, out / f"ray-{routing}.log", timeout=1800) as url:
        with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
            played = list(pool.map(lambda s: play(url, s, args.max_tokens), sessions))
    later = [t for turns in played for t in turns[1:]]
    return {"routing": routing, "sessions": len(played),
            "cached_share_later": round(sum(t.cached_tokens or 0 for t in later) / max(1, sum(t.prompt_tokens for t in later)), 3),
            "session_s": round(statistics.mean(sum(t.seconds for t in turns) for turns in played), 2),
            "ttft_later_s": round(statistics.mean(t.ttft for t in later), 3)}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--file-chars", type=int, default=3000, help="characters of the source file each session reads")
    p.add_argument("--routings", default="prefix,random")
    p.add_argument("--out", default="forerun-runs/ray-routing")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for routing in args.routings.split(","):
        print(json.dumps(run(routing, args, extra, out)), flush=True)


if __name__ == "__main__":
    main()
