"""Structured-output workloads against OpenAI-style servers: JSON extraction with a strict
`json_schema`, and tool calls with `tool_choice: required`, built at run time from the Python
standard library's function docstrings (never stored). Per server: seconds per request,
completion tokens per second end to end and while decoding (the server's own clock: forerun's
`prefill_s` / `decode_s`, llama-server's `timings`), share of outputs that validate, and which outputs
are identical to the first server's (plain decoding first: speculation must not change a
token).

    python -m forerun.bench.structured --kind json --tasks 8 --max-tokens 256 \\
        --forerun "--model qwen2.5-coder-1.5b --dtype gguf --method none" \\
        --forerun "--model qwen2.5-coder-1.5b --dtype gguf --method draft_model --draft-model qwen2.5-coder-0.5b --k 4" \\
        --llama-server /path/to/llama-server --gguf <the 1.5B's .gguf> --out forerun-runs/structured

Every server starts once and is kept; the tasks are played one after another, the servers
taking turns task by task. Greedy. llama-server gets `--jinja` (its tool calls need it).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import time
from pathlib import Path

import httpx

from forerun.bench.sessions import MODULES, _functions

SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "parameters": {"type": "array", "maxItems": 6, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "meaning": {"type": "string", "maxLength": 100}},
            "required": ["name", "meaning"], "additionalProperties": False}},
        "returns": {"type": "string", "maxLength": 100},
    },
    "required": ["function", "summary", "parameters", "returns"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {
    "name": "record_function", "description": "Record what a function of the code base does.",
    "parameters": SCHEMA}}


def tasks(n: int) -> list[tuple[str, str]]:
    """(function name, its signature and docstring) from the standard library's modules."""
    out = []
    for module in MODULES:
        mod = importlib.import_module(module)
        for name, doc in _functions(Path(mod.__file__).read_text()):
            fn = getattr(mod, name, None)
            try:
                sig = str(inspect.signature(fn)) if fn is not None else "(...)"
            except (TypeError, ValueError):
                sig = "(...)"
            out.append((name, f"def {name}{sig}:\n    \"\"\"{doc}\"\"\""))
            if len(out) == n:
                return out
    return out


def body(kind: str, source: str, max_tokens: int) -> dict:
    ask = f"Describe this function of the Python standard library as JSON.\n\n```python\n{source}\n```"
    b = {"messages": [{"role": "user", "content": ask}], "max_tokens": max_tokens, "temperature": 0}
    if kind == "json":
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA, "strict": True}}
    else:
        b["messages"][0]["content"] = ask.replace("as JSON", "by calling record_function")
        b.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    return b


def valid(value, schema: dict = SCHEMA) -> bool:
    """The extraction schema's rules, checked by hand (types, required keys, no others, lengths)."""
    if not isinstance(value, dict) or set(value) != set(schema["required"]):
        return False
    ok = all(isinstance(value[k], str) and len(value[k]) <= schema["properties"][k]["maxLength"]
             for k in ("function", "summary", "returns"))
    params = value["parameters"]
    return ok and isinstance(params, list) and len(params) <= 6 and all(
        isinstance(p, dict) and set(p) == {"name", "meaning"} and all(isinstance(v, str) for v in p.values()) for p in params)


def ask(client: httpx.Client, kind: str, source: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body(kind, source, max_tokens))
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    reply = r.json()
    choice = reply["choices"][0]
    if kind == "json":
        text = choice["message"].get("content") or ""
    else:
        calls = choice["message"].get("tool_calls") or []
        text = calls[0]["function"]["arguments"] if calls else (choice["message"].get("content") or "")
    try:
        ok = valid(json.loads(text))
    except ValueError:
        ok = False
    prefill_s, decode_s = server_clock(reply)
    return {"seconds": seconds, "tokens": reply["usage"]["completion_tokens"], "text": text, "valid": ok,
            "finish": choice["finish_reason"], "forerun": reply.get("forerun"), "prefill_s": prefill_s, "decode_s": decode_s}


def server_clock(reply: dict) -> tuple[float | None, float | None]:
    """(seconds of prompt, seconds of decoding) as the server timed them: forerun's `forerun`
    field, llama-server's `timings` (milliseconds); None where the server does not say."""
    ours, theirs = reply.get("forerun") or {}, reply.get("timings") or {}
    if "decode_s" in ours:
        return ours.get("prefill_s"), ours["decode_s"]
    if "predicted_ms" in theirs:
        return theirs.get("prompt_ms", 0.0) / 1e3, theirs["predicted_ms"] / 1e3
    return None, None


def summary(runs: list[dict], reference: list[dict]) -> dict:
    finished = [r for r in runs if r["finish"] != "length"]
    tau = [r["forerun"].get("mean_accepted_length") for r in runs if r.get("forerun")]
    forced = sum(r["forerun"].get("forced", 0) for r in runs if r.get("forerun")) if tau else None
    timed = all(r.get("decode_s") for r in runs)
    return {"requests": len(runs), "s_per_request": round(statistics.mean(r["seconds"] for r in runs), 2),
            "tok_s": round(sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs), 2),
            "decode_tok_s": round(sum(r["tokens"] for r in runs) / sum(r["decode_s"] for r in runs), 2) if timed else None,
            "prefill_s": round(statistics.mean(r["prefill_s"] or 0.0 for r in runs), 3) if timed else None,
            "valid_share": round(sum(r["valid"] for r in finished) / max(1, len(finished)), 3),
            "cut_at_max_tokens": len(runs) - len(finished),
            "identical_to_first": sum(r["text"] == q["text"] for r, q in zip(runs, reference)),
            "tau": round(statistics.mean(tau), 3) if tau else None, "forced": forced}


def build_parser() -> argparse.ArgumentParser:
    from forerun.bench.launch import add_server_options

    p = argparse.ArgumentParser(prog="python -m forerun.bench.structured", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kind", choices=["json", "tools"], default="json")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    add_server_options(p, 4096, "forerun-runs/structured")  # (llama-server runs with --jinja: its tool calls need it)
    return p


def main(argv: list[str] | None = None) -> None:
    from forerun.bench.launch import Servers, out_dir, server_argvs

    args = build_parser().parse_args(argv)
    out = out_dir(args.out)
    servers = server_argvs(args.forerun, args.max_len, args.llama_server, args.gguf, args.threads, args.llama_extra,
                           llama_flags=("--jinja",))
    work = tasks(args.tasks)
    results: dict[str, list[dict]] = {label: [] for label, _ in servers}
    with Servers(servers, out) as urls:
        for name, source in work:
            for label, url in urls:
                with httpx.Client(base_url=url, timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                    run = ask(client, args.kind, source, args.max_tokens)
                results[label].append(run)
                print(json.dumps({"server": label, "task": name, **{k: run[k] for k in ("seconds", "tokens", "valid", "finish")}}),
                      flush=True)
    first = next(iter(results.values()))
    report = {label: summary(runs, first) for label, runs in results.items()}
    (out / f"structured-{args.kind}.json").write_text(json.dumps({"report": report, "runs": results}, indent=1))
    for label, figures in report.items():
        print(f"{label}: {json.dumps(figures)}")


if __name__ == "__main__":
    main()
