"""logit_bias and the repetition penalties (OpenAI's presence / frequency, vLLM's repetition),
per row, at every drafted position, so speculation keeps them exact.

The order is vLLM's: a grammar's mask first (constrain.py), then logit_bias, then the
penalties, then temperature / top-k / top-p (sampling.logits_to_probs). A penalty depends on
the tokens generated so far, so at draft position j it counts the generated tokens plus the
draft's first j tokens: the verifier's p at each position is the one plain decoding would
compute after those tokens, which is what verification needs to stay exact.

    repetition (vLLM / HF, prompt and output tokens):    l > 0 ? l / r : l * r
    then presence / frequency (OpenAI, output tokens):    l -= frequency * count + presence * (count > 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @classmethod
    def of(cls, params) -> "Penalties | None":
        """The row's from SamplingParams; None where it changes nothing."""
        p = cls(tuple(sorted((params.logit_bias or {}).items())), params.presence_penalty, params.frequency_penalty,
                params.repetition_penalty)
        return p if (p.bias or p.presence or p.frequency or p.repetition != 1.0) else None


def apply(logits: torch.Tensor, raw: torch.Tensor, rows: list, drafts: list) -> torch.Tensor:
    """logits [B, T, V] (already masked, or `raw` itself) with each row's Penalties applied at
    its positions 0 .. len(draft); rows: engine.Sequence with `.penalties`, `.tokens`,
    `.prompt_len`. A copy is made before writing when logits is the raw tensor (kept for logprobs)."""
    if all(s.penalties is None for s in rows):
        return logits
    out = logits.clone() if logits is raw else logits
    V = logits.shape[-1]
    for b, (s, d) in enumerate(zip(rows, drafts)):
        if s.penalties is not None:
            _row(out[b, : len(d.tokens) + 1], s, d.tokens, s.penalties, V)
    return out


def _row(x: torch.Tensor, s, draft: list[int], p: Penalties, V: int) -> None:
    """x [n + 1, V] in place: position j follows the committed tokens and draft[:j]."""
    n1, dev = x.shape[0], x.device
    for tok, bias in p.bias:
        if 0 <= tok < V:
            x[:, tok] += bias
    if not (p.presence or p.frequency or p.repetition != 1.0):
        return
    out = torch.tensor(s.tokens[s.prompt_len :] + draft[: n1 - 1], dtype=torch.long, device=dev)
    base = len(s.tokens) - s.prompt_len  # output tokens every position has seen
    # counts[j] = output-token counts seen at position j: the committed ones plus draft[:j]
    steps = torch.zeros(n1, V, dtype=x.dtype, device=dev)
    if base:
        steps[0].index_add_(0, out[:base], torch.ones(base, dtype=x.dtype, device=dev))
    if n1 > 1:
        steps[1:].scatter_add_(1, out[base:, None], torch.ones(n1 - 1, 1, dtype=x.dtype, device=dev))
    counts = steps.cumsum(0)
    if p.repetition != 1.0:  # (vLLM's order: repetition, then frequency and presence)
        seen = counts > 0
        seen[:, torch.tensor(sorted(set(s.tokens[: s.prompt_len])), dtype=torch.long, device=dev)] = True
        x.copy_(torch.where(seen, torch.where(x > 0, x / p.repetition, x * p.repetition), x))
    if p.frequency or p.presence:
        x -= p.frequency * counts + p.presence * (counts > 0).to(x.dtype)
