"""forerun's logprobs (one {token id: Logprob} per token, the chosen token first) in the two
shapes OpenAI's API returns, which vLLM's server and OpenAI's clients parse:

completions:  {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
               "text_offset": [int]}   (echo: the prompt's tokens first, the first one None)
chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's string is its own text (Logprob.decoded_token). Chat's `top_logprobs` lists the N most
likely tokens only (OpenAI's shape); completions' dict also holds the chosen token, as vLLM's does.
"""
from __future__ import annotations

from forerun.logprobs import TokenLogprobs


def _chosen(entry: TokenLogprobs):
    token = next(iter(entry))  # the chosen token is the dict's first key (logprobs.token_logprobs)
    return token, entry[token]


def _text(lp) -> str:
    return lp.decoded_token or ""


def completion_logprobs(entries: list[TokenLogprobs | None], tokens: list[int], pieces, offset: int = 0) -> dict:
    """entries (None for a prompt's first token) of `tokens`; pieces: token id -> text; offset:
    the text_offset of the first token (where it starts in the choice's text)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(tokens, entries):
        text = pieces(tok) if entry is None else _text(entry[tok])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[tok].logprob)
        top: dict[str, float] = {}
        for lp in sorted(entry.values(), key=lambda lp: lp.rank):
            top.setdefault(_text(lp), lp.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: list[TokenLogprobs], top_n: int) -> dict:
    content = []
    for entry in entries:
        _, lp = _chosen(entry)
        best = sorted(entry.values(), key=lambda x: x.rank)[:top_n]
        content.append({"token": _text(lp), "logprob": lp.logprob, "bytes": list(_text(lp).encode()),
                        "top_logprobs": [{"token": _text(x), "logprob": x.logprob, "bytes": list(_text(x).encode())}
                                         for x in best]})
    return {"content": content}
