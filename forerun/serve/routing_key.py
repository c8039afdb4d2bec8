"""The key `python -m forerun.serve.ray_app --routing prefix` routes a request by (ray_routing.py):
every turn of a session must get the same key, so that its turns reach the replica whose prefix
cache holds the session.

OpenAI's `prompt_cache_key` when the request sends one; else a hash of what every later turn of a
session resends unchanged: a chat's (or a Responses request's) messages up to and including the
first user message, with the Responses `instructions`, or the first PREFIX_CHARS characters of a
completion's prompt; at most PREFIX_CHARS of text either way. A turn's first user message is the
anchor: a chat without a system prompt sends [user] on turn 1 and [user, assistant, user] on turn
2, so "the first two messages" would differ; and a Responses `input` given as a string is that one
user message.
"""
from __future__ import annotations

import hashlib
import json

PREFIX_CHARS = 2048  # about 32 KV blocks of 16 tokens


def routing_key(body: bytes) -> str:
    """The request's key (see the module docstring); "" for a body that is not a JSON object.
    >>> routing_key(b'{"prompt_cache_key": "s1", "messages": []}') == routing_key(b'{"prompt_cache_key": "s1"}')
    True
    >>> turn1 = [{"role": "user", "content": "u"}]
    >>> turn2 = turn1 + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    >>> routing_key(json.dumps({"messages": turn1}).encode()) == routing_key(json.dumps({"messages": turn2}).encode())
    True
    >>> routing_key(b'{"input": "u"}') == routing_key(json.dumps({"input": turn2}).encode())
    True
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(obj, dict):
        return ""
    if isinstance(obj.get("prompt_cache_key"), str):
        return "key:" + obj["prompt_cache_key"]
    if "messages" in obj or "input" in obj:
        items = obj.get("messages", obj.get("input"))
        if isinstance(items, str):  # a Responses input given as text: one user message
            items = [{"role": "user", "content": items}]
        start = [obj.get("instructions"), opening(items)] if isinstance(items, list) else items
    else:
        start = obj.get("prompt", "")
    text = json.dumps(start, ensure_ascii=False, separators=(",", ":"))[:PREFIX_CHARS]
    return hashlib.sha256(text.encode()).hexdigest()


def opening(items: list) -> list:
    """A conversation's messages up to and including its first user message, each as (role,
    text): a message's content given as text parts ({"type": "input_text", "text": ...}) reads
    as their text, so a client that sends turn 1 as a string and turn 2 as parts keeps its key.
    >>> opening([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "input_text", "text": "u"}]},
    ...          {"role": "assistant", "content": "a"}])
    [['system', 's'], ['user', 'u']]
    """
    out = []
    for item in items:
        if not isinstance(item, dict):
            out.append(item)
            continue
        content = item.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        out.append([item.get("role"), content])
        if item.get("role") == "user":
            break
    return out


def ranking(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, best first, for `key` (rendezvous hashing: highest sha256(key, id) first).
    >>> ranking("k", ["a", "b", "c"]) == ranking("k", ["c", "a", "b"])
    True
    """
    return sorted(replica_ids, key=lambda r: hashlib.sha256(f"{key}|{r}".encode()).digest(), reverse=True)
