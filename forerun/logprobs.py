"""Log-probabilities of chosen tokens and their top alternatives, shaped as vLLM returns them.

Which distribution: the model's raw one, log_softmax of the verifier's logits at the position,
before temperature, top-k and top-p (vLLM's default, `logprobs_mode="raw_logprobs"`). A token
emitted by speculation is scored from the logits row of the verifier forward that accepted it
(or that drew the recovered / bonus token), which are the logits plain decoding computes for
that position: at the batch-invariant precisions bit for bit, so the logprobs are too. Each row
is computed alone (a 1-D log_softmax), so its bits never depend on how many rows a forward had.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.errors import ConfigError

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (OpenAI's top_logprobs allows 0..20)


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token under the raw distribution
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # token id -> Logprob: the chosen token and the top N


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """logits [V] of one position -> {the chosen token and the `top` most likely: Logprob}.
    The chosen token comes first; ties in the top N keep torch.topk's order.
    >>> out = token_logprobs(torch.tensor([0.0, 2.0, 1.0]), 2, 1)
    >>> [(t, round(lp.logprob, 4), lp.rank) for t, lp in out.items()]
    [(2, -1.4076, 2), (1, -0.4076, 1)]
    """
    lp = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    chosen = lp[token]
    out = {int(token): Logprob(float(chosen), int((lp > chosen).sum()) + 1)}
    if top > 0:
        values, ids = lp.topk(min(top, lp.shape[-1]))
        for rank, (v, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(i, Logprob(v, rank))
    return out


def sequence_logprobs(logits: torch.Tensor, tokens: list[int], top: int, rows=None) -> list[TokenLogprobs]:
    """logits [T, V] and the token chosen after each position -> one dict per token; rows[j]: the
    position that predicted tokens[j] (default 0, 1, 2, ...; a token tree's accepted path skips)."""
    rows = range(len(tokens)) if rows is None else rows
    return [token_logprobs(logits[r], t, top) for r, t in zip(rows, tokens)]


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprobs | None]:
    """Teacher-forced logits [T, V] of a prompt -> None for its first token (nothing predicts
    it), then each token scored by the position before it."""
    return [None, *sequence_logprobs(logits[:-1], ids[1:], top)]


def with_text(entries: list, decode) -> list:
    """Fill decoded_token (decode: token id -> its text) in every dict of entries (None kept)."""
    return [None if e is None else {t: Logprob(lp.logprob, lp.rank, decode(t)) for t, lp in e.items()} for e in entries]


def check_count(name: str, n: int | None) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS:
        raise ConfigError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {n!r}")
