"""Agent sessions against OpenAI-style servers: every turn resends the whole conversation (a
system prompt with tool schemas, a source file, the earlier answers and tool results) and asks
for the next step, as coding assistants and agents do. Measures per server: session time,
time to first token per turn, decode tok/s, and the prompt tokens the server reported cached.

Sessions are built at run time from the Python standard library (a module's source as the
file read, its functions' docstrings as tool results), never stored:

    python -m forerun.bench.sessions --sessions 2 --turns 4 --max-tokens 160 \\
        --forerun "--model qwen2.5-coder-1.5b --dtype gguf --method draft_model --draft-model qwen2.5-coder-0.5b" \\
        --forerun "--model qwen2.5-coder-1.5b --dtype gguf --method none --no-prefix-cache" \\
        --llama-server /path/to/llama-server --gguf <the 1.5B's .gguf> --out forerun-runs/sessions

Each server is started once (a subprocess on a free port) and kept for every session; the
sessions are played one after another, and within a session the servers take turns turn by
turn (each with its own history), so the machine's drift, which moves its speed 10-20% within
minutes, hits every server alike; each session's time is also given as a ratio to the first
server's. Greedy decoding, `ignore_eos` off: a turn ends where the model ends it or at
--max-tokens.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from forerun.bench.loadgen import ChatStream

# (at 4 turns, bisect and calendar come first; the modules after them let --sessions go to 8)
MODULES = ("textwrap", "difflib", "shlex", "fractions", "heapq", "bisect", "calendar", "string",
           "posixpath", "genericpath", "base64", "fnmatch", "linecache", "pprint")
TOOLS = [  # the schemas an agent's system prompt carries (the shape of OpenAI's function tools)
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "run_tests", "description": "Run the repository's tests; returns their output.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}},
    {"name": "search", "description": "Search the repository for a string.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
]
ASKS = ("Rewrite `{name}` with type hints, keeping its behaviour, and show the whole function.",
        "The tests of `{name}` fail with the output below. Explain why in two sentences, then show a fix.",
        "Add a docstring example to `{name}` and show the whole function again.",
        "Show `{name}` again with its body unchanged but its local names made clearer.")


@dataclass
class Session:
    """The turns of one agent session: the opening messages, then one user message per turn."""

    module: str
    opening: list[dict]
    asks: list[str]


def _functions(source: str) -> list[tuple[str, str]]:
    """(name, docstring) of the module's top-level functions that have a docstring."""
    tree = ast.parse(source)
    return [(n.name, ast.get_docstring(n) or "") for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)]


def build_sessions(n: int, turns: int, file_chars: int = 6000) -> list[Session]:
    """n sessions of `turns` turns over different standard-library modules."""
    out = []
    for module in MODULES:
        if len(out) == n:
            break
        path = Path(importlib.import_module(module).__file__)
        source = path.read_text()
        funcs = [f for f in _functions(source) if f"def {f[0]}(" in source[:file_chars]]
        if len(funcs) < turns:
            continue
        system = ("You are a coding agent working in a Python repository. You can call these tools:\n"
                  + json.dumps(TOOLS, indent=1) + "\nAnswer with code where code is asked for.")
        user = f"Here is {path.name}, as read_file returned it:\n```python\n{source[:file_chars]}\n```"
        asks = []
        for t in range(turns):
            name, doc = funcs[t]
            ask = ASKS[t % len(ASKS)].format(name=name)
            if t:  # a tool's result comes back with the request
                ask += "\n\nTool result:\n" + "\n".join(doc.splitlines()[:6])
            asks.append(ask)
        out.append(Session(module, [{"role": "system", "content": system}, {"role": "user", "content": user}], asks))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} standard-library modules make sessions of {turns} turns")
    return out


@dataclass
class Turn:
    ttft: float  # seconds to the first streamed token
    seconds: float  # the whole turn
    tokens: int  # completion tokens (the server's usage)
    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, where the server says it
    text: str = field(repr=False, default="")

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / (self.seconds - self.ttft) if self.tokens > 1 and self.seconds > self.ttft else 0.0


def stream_chat(client: httpx.Client, messages: list[dict], max_tokens: int) -> Turn:
    """One greedy chat completion, streamed: its time to first token, whole time, text and the
    server's usage (completion, prompt and cached prompt tokens)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    s = ChatStream(time.perf_counter())
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            s.feed(line)
    usage = s.usage
    details = usage.get("prompt_tokens_details") or {}
    return Turn(s.first or 0.0, time.perf_counter() - s.t0, usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                details.get("cached_tokens"), "".join(s.pieces))


def next_messages(session: Session, messages: list[dict], turn: int) -> list[dict]:
    """The request of turn `turn` (0-based): the history so far and the turn's ask (the first
    ask joins the opening user message)."""
    ask = session.asks[turn]
    if turn:
        return messages + [{"role": "user", "content": ask}]
    return messages[:-1] + [{"role": "user", "content": messages[-1]["content"] + "\n\n" + ask}]


def play(url: str, session: Session, max_tokens: int) -> list[Turn]:
    """Every turn of `session` in order, each resending the history with the last answer."""
    return play_interleaved([url], session, max_tokens)[0]


def play_interleaved(urls: list[str], session: Session, max_tokens: int) -> list[list[Turn]]:
    """`session` on every server, the servers taking turns turn by turn (each keeps its own
    history: its own answers are what it is sent back); turns per server."""
    histories = [list(session.opening) for _ in urls]
    turns: list[list[Turn]] = [[] for _ in urls]
    # llama-server closes a connection after a stream: a fresh one per request
    clients = [httpx.Client(base_url=u, timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) for u in urls]
    try:
        for i in range(len(session.asks)):
            for j, client in enumerate(clients):
                messages = next_messages(session, histories[j], i)
                turn = stream_chat(client, messages, max_tokens)
                turns[j].append(turn)
                histories[j] = messages + [{"role": "assistant", "content": turn.text}]
    finally:
        for client in clients:
            client.close()
    return turns


def summary(turns: list[list[Turn]]) -> dict:
    """Figures over sessions: session time, TTFT of the first and later turns, decode tok/s."""
    later = [t for s in turns for t in s[1:]]
    short = [t for t in later if t.cached_tokens is not None and t.prompt_tokens - t.cached_tokens < 100]
    return {"sessions": len(turns), "session_s": round(statistics.mean(sum(t.seconds for t in s) for s in turns), 2),
            "ttft_first_s": round(statistics.mean(s[0].ttft for s in turns), 2),
            "ttft_later_s": round(statistics.mean(t.ttft for t in later), 3) if later else None,
            # the case: a later turn that leaves under 100 prompt tokens to compute
            "ttft_later_under_100_new_s": round(statistics.mean(t.ttft for t in short), 3) if short else None,
            "decode_tok_s": round(sum(t.tokens - 1 for s in turns for t in s)
                                  / sum(t.seconds - t.ttft for s in turns for t in s), 2),
            "cached_share_later": round(sum(t.cached_tokens or 0 for t in later) / max(1, sum(t.prompt_tokens for t in later)), 3),
            "tokens": sum(t.tokens for s in turns for t in s)}


def build_parser() -> argparse.ArgumentParser:
    from forerun.bench.launch import add_server_options

    p = argparse.ArgumentParser(prog="python -m forerun.bench.sessions", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    add_server_options(p, 8192, "forerun-runs/sessions")
    return p


def main(argv: list[str] | None = None) -> None:
    from forerun.bench.launch import server_argvs

    args = build_parser().parse_args(argv)
    servers = server_argvs(args.forerun, args.max_len, args.llama_server, args.gguf, args.threads, args.llama_extra)
    play_all(servers, build_sessions(args.sessions, args.turns), args.max_tokens, args.out)


def play_all(servers: list[tuple[str, list[str]]], sessions: list[Session], max_tokens: int, out: str) -> dict:
    """Start every server ((label, argv with "{port}")), play the sessions one after another,
    the servers taking turns turn by turn; print a line per session and server, then each
    server's summary (also written to out/sessions.json), which it returns."""
    from forerun.bench.launch import Servers, out_dir

    out_path = out_dir(out)
    results: dict[str, list[list[Turn]]] = {}
    with Servers(servers, out_path) as urls:
        for session in sessions:
            played = play_interleaved([url for _, url in urls], session, max_tokens)
            first_s = sum(t.seconds for t in played[0])
            for (label, _), turns in zip(urls, played):
                results.setdefault(label, []).append(turns)
                session_s = sum(t.seconds for t in turns)
                print(json.dumps({"server": label, "module": session.module, "session_s": round(session_s, 2),
                                  "vs_first": round(session_s / first_s, 3) if first_s else None,
                                  "ttft_s": [round(t.ttft, 2) for t in turns], "tokens": [t.tokens for t in turns],
                                  "prompt": [t.prompt_tokens for t in turns], "cached": [t.cached_tokens for t in turns]}),
                      flush=True)
    report = {label: summary(turns) for label, turns in results.items()}
    (out_path / "sessions.json").write_text(json.dumps(report, indent=1))
    for label, figures in report.items():
        print(f"{label}: {json.dumps(figures)}")
    return report


if __name__ == "__main__":
    main()
