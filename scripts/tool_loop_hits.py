"""How much of a tool call's turn the next turn reads from the server's prefix cache.

    python scripts/tool_loop_hits.py --tasks 4 -- --model qwen2.5-coder-1.5b --dtype gguf --method suffix --k 8

A tool loop's second request resends the first: its prompt, the assistant message with the
`tool_calls` the model emitted (its `arguments` a JSON string), then a `role: tool` result. The
hit reaches through the call only where the history renders back to the tokens the model wrote.
Per task (`forerun.bench.structured`'s tool tasks, `tool_choice: required`): turn 1's computed
tokens (its prompt and the call but the call's last token, whose K/V no step wrote), turn 2's
`cached_tokens`, and their ratio. Everything after `--` is `forerun serve`'s options.
"""
import argparse
import json
import sys
from pathlib import Path

import httpx

from forerun.bench.launch import Launched, free_port
from forerun.bench.structured import TOOL, body, tasks


def second_turn(first: dict, reply: dict) -> dict:
    """The tool loop's next request: the history with the call and a tool result."""
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    if not calls:
        raise RuntimeError(f"turn 1 made no call: {reply['choices'][0]}")
    messages = first["messages"] + [{"role": "assistant", "content": None, "tool_calls": calls},
                                    {"role": "tool", "tool_call_id": calls[0]["id"], "content": "recorded"}]
    return {"messages": messages, "tools": [TOOL], "max_tokens": 16, "temperature": 0}


def main(argv: list[str]) -> None:
    ours, serve = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--log", default="forerun-runs/tool_loop_hits.log")
    args = ap.parse_args(ours)
    port = free_port()
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    shares = []
    with Launched(["forerun", "serve", *serve, "--port", str(port)], port, Path(args.log)) as url, \
            httpx.Client(base_url=url, timeout=3600) as client:
        for name, source in tasks(args.tasks):
            first = body("tools", source, 300)
            reply = client.post("/v1/chat/completions", json=first).json()
            usage1 = reply["usage"]
            usage2 = client.post("/v1/chat/completions", json=second_turn(first, reply)).json()["usage"]
            computed = usage1["prompt_tokens"] + usage1["completion_tokens"] - 1
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            shares.append(cached / computed)
            print(json.dumps({"function": name, "turn1_prompt": usage1["prompt_tokens"], "turn1_call": usage1["completion_tokens"],
                              "turn1_computed": computed, "turn2_prompt": usage2["prompt_tokens"], "turn2_cached": cached,
                              "share": round(cached / computed, 4)}), flush=True)
    print(f"turn 2 read {100 * sum(shares) / len(shares):.1f}% of turn 1's computed tokens (mean over {len(shares)} tasks)")


if __name__ == "__main__":
    main(sys.argv[1:])
