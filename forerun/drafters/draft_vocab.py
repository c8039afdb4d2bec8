"""A reduced output vocabulary for a draft model's LM head (after FR-Spec): the drafter scores
only a subset of tokens, cutting its largest matrix (Qwen2.5-0.5B: 136M of its 494M weights
are the 151,936-row head), while the verifier still scores the full vocabulary, so
verification stays exact: q is the drafter's distribution over the subset, zero elsewhere,
and rejection sampling corrects for that like for any other q.

Which tokens: a byte-level BPE numbers its tokens in merge order, and merges are learned
most-frequent first, so the first N ids are a frequency ranking the tokenizer already holds;
every id past the base vocabulary (special tokens: <|im_end|>, <|endoftext|>...) is kept too,
because a chat turn must be able to end in a draft.

A drafter also scores its rows' context ids outside that set (ContextHead below: the
prompt's and the output's tokens so far, through float rows of the full head): names,
numbers and rare words are copied from the prompt far more often than chance. Qwen2.5-Coder-1.5B's
greedy answers to 2 prompts of each Spec-Bench subtask and HumanEval: the first 32,768 ids cover
92.9% of their tokens, with the prompt's ids 96.7% (summarization 89.6% -> 99.5%); the first
65,536 ids 98.1%, with the prompt's 99.7%.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from forerun.sampling import argmax


def kept_ids(vocab_size: int, keep: int, special_ids: set[int]) -> torch.Tensor:
    """[n] sorted ids: 0 .. keep-1 and every special id below vocab_size.
    >>> kept_ids(10, 4, {8, 3}).tolist()
    [0, 1, 2, 3, 8]
    """
    ids = set(range(min(keep, vocab_size))) | {i for i in special_ids if 0 <= i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def float_rows(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The head's float weights [len(ids), hidden] for the kept rows, whatever its kind
    (nn.Linear, forerun's float32 kernel, its int8 linear: scale x int8 rows, or its int4
    linear), reading only those rows (context ids change during a generation)."""
    if hasattr(head, "weight_int8"):
        return head.weight_int8[ids].float() * head.weight_scale[ids, None]
    if hasattr(head, "float_rows"):  # a GGUF linear: those rows' blocks, dequantized
        return head.float_rows(ids)
    if hasattr(head, "u4_rows"):
        from forerun.linears.int4 import dequantize_groups

        return dequantize_groups(head.u4_rows(ids), head.weight_d[ids], head.weight_m[ids], head.in_features)
    if hasattr(head, "weight_packed"):  # the float32 kernel's [M/16, K, 16]: row j is lane j % 16 of block j // 16
        return head.weight_packed[ids // 16, :, ids % 16]
    return head.weight.detach()[ids]


class ReducedHead(nn.Module):
    """hidden [B, C] -> logits [B, V] with -inf outside the kept ids (the verifier's width),
    and outside the `extra` ids given per call (context ids, scored through float rows of the
    full head, gathered once per distinct set)."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int, dtype: str):
        super().__init__()
        if hasattr(head, "select_rows") and dtype in ("gguf", "int4"):  # GGUF blocks: the kept rows' own
            sub = head.select_rows(ids)
            if dtype == "int4":  # int4 of blocks: Q4_K kept as they are, any other type fitted from its values
                from forerun.linears.int4 import int4_of_blocks

                sub = int4_of_blocks(sub)
            self.head = sub
        else:
            rows = float_rows(head, ids)  # [n, hidden]
            sub = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            sub.weight = nn.Parameter(rows, requires_grad=False)
            self.head = _like(sub, dtype)
        self.register_buffer("ids", ids, persistent=False)
        self.vocab_size = vocab_size
        self.kept = set(ids.tolist())
        self.full_size = head.out_features  # rows of the full head: context ids must be below it
        self._full_rows = lambda extra: float_rows(head, extra)  # a plain callable: not a submodule
        self._extra: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None  # (ids, id tensor, rows)

    def forward(self, hidden: torch.Tensor, extra: list[int] | None = None) -> torch.Tensor:
        """extra: sorted ids outside the kept set to score as well (None or empty: none)."""
        sub = self.head(hidden).float()
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        full.index_copy_(-1, self.ids, sub)
        if extra:
            at, scores = self._extra_scores(hidden, extra)
            full.index_copy_(-1, at, scores)
        return full

    def pick(self, hidden: torch.Tensor, extra: list[int] | None = None) -> list[int]:
        """[N] ids: argmax(-1) of forward(hidden, extra) for hidden [N, C], found without
        writing the verifier-wide row (a greedy drafter needs only the pick): the best kept id
        against the best extra id, ties to the lower id and a NaN counting as the largest, as
        argmax over the whole row does."""
        sub = self.head(hidden).float()  # [N, n]
        best = argmax(sub)
        ids = self.ids[best].tolist()
        if not extra:
            return ids
        at, scores = self._extra_scores(hidden, extra)  # [m], [N, m]
        eb = argmax(scores)
        vals, evals = sub.gather(-1, best[:, None])[:, 0].tolist(), scores.gather(-1, eb[:, None])[:, 0].tolist()
        return [_first_largest(i, v, e, ev) for i, v, e, ev in zip(ids, vals, at[eb].tolist(), evals)]

    def _extra_scores(self, hidden: torch.Tensor, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [m], their logits [N, m]) through float rows of the full head, gathered once per distinct set."""
        key = tuple(extra)
        if self._extra is None or self._extra[0] != key:
            at = torch.tensor(key, dtype=torch.long, device=self.ids.device)
            self._extra = (key, at, self._full_rows(at).float())  # [m, hidden]
        _, at, rows = self._extra
        return at, hidden.float() @ rows.T


def _first_largest(i: int, v: float, j: int, w: float) -> int:
    """Of ids i and j with logits v and w, the one argmax over a row holding both picks.
    >>> _first_largest(5, 1.0, 3, 1.0), _first_largest(5, float("nan"), 3, 2.0), _first_largest(5, 1.0, 3, float("nan"))
    (3, 5, 3)
    """
    if math.isnan(v) or math.isnan(w):
        return i if math.isnan(v) and (not math.isnan(w) or i < j) else j
    return i if v > w or (v == w and i < j) else j


class ContextIds:
    """Per cache row, the ids of its tokens (prompt and output so far) outside a ReducedHead's
    kept set, scanned incrementally as the row grows."""

    def __init__(self, head: ReducedHead):
        self.head = head
        self.rows: dict[int, tuple[set[int], int]] = {}  # row -> (ids outside, tokens scanned)

    def update(self, requests) -> list[int]:
        """Sorted union over these DraftRequests' rows (their tokens read up to now)."""
        union: set[int] = set()
        for r in requests:
            ids, scanned = self.rows.get(r.row, (set(), 0))
            ids |= {t for t in r.tokens[scanned:] if t not in self.head.kept and 0 <= t < self.head.full_size}
            self.rows[r.row] = (ids, len(r.tokens))
            union |= ids
        return sorted(union)

    def forget(self, row: int) -> None:
        self.rows.pop(row, None)


class ContextHead:
    """A ReducedHead that also scores the context ids of the rows being drafted for: a drafter
    calls `for_rows(requests)` once per step, then uses it as hidden -> logits as before."""

    def __init__(self, head: ReducedHead):
        self.head, self.context, self.extra = head, ContextIds(head), []

    def for_rows(self, requests) -> None:
        self.extra = self.context.update(requests)

    def forget(self, row: int) -> None:
        self.context.forget(row)

    def reset(self) -> None:
        self.context.rows.clear()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden, self.extra)

    def pick(self, hidden: torch.Tensor) -> list[int]:
        return self.head.pick(hidden, self.extra)


def reduced_head(spec, llm, vocab: int):
    """The draft_vocab option (spec.options["draft_vocab"] = N): a ReducedHead over `llm`'s LM
    head rows for ids 0 .. N-1 + its special ids, `vocab` wide, wrapped in a ContextHead unless
    options["draft_vocab_context"] is False; None when the option is unset. The sub-head runs at
    options["head_dtype"] ("int8", "int4", "float32"; default `llm`'s dtype), as a head drafter's
    own layers do (checkpoint.at_verifier_precision): it only scores drafts, so a cheaper copy
    under a float32 verifier changes acceptance, never the output."""
    keep = spec.options.get("draft_vocab")
    if not keep:
        return None
    dtype = spec.options.get("head_dtype") or llm.dtype  # the sub-head's own precision (drafts only)
    head = ReducedHead(llm.model.lm_head, llm_kept_ids(llm, int(keep), vocab), vocab, dtype)
    return ContextHead(head) if spec.options.get("draft_vocab_context", True) else head


# A drafter's hooks for whatever scores its guesses (no-ops unless it is a ContextHead):
def for_rows(logits, requests) -> None:
    """Each step, before scoring: the rows being drafted for."""
    if isinstance(logits, ContextHead):
        logits.for_rows(requests)


def forget_row(logits, row: int) -> None:
    """A row taken by a new sequence (the server's continuous batching)."""
    if isinstance(logits, ContextHead):
        logits.forget(row)


def reset_rows(logits) -> None:
    """A new generate call (every row new)."""
    if isinstance(logits, ContextHead):
        logits.reset()


def llm_kept_ids(llm, keep: int, vocab: int | None = None) -> torch.Tensor:
    """kept_ids for an LLM: its first `keep` ids + its tokenizer's special and EOS ids, below
    min(vocab, the model's vocabulary). Drafting (draft_vocab) and training (--vocab) share it."""
    tok = llm.tokenizer
    special = set(getattr(tok, "special_ids", ())) | set(tok.eos_token_ids) if tok is not None else set()
    size = llm.model.config.vocab_size
    return kept_ids(size if vocab is None else min(vocab, size), keep, special)


def head_logits(spec, verifier):
    """What a head drafter (Medusa, EAGLE, block) scores its guesses with: the verifier's own
    LM head (`hidden_to_logits`), or its reduced_head under draft_vocab (by default the
    vocabulary the head was trained over, `forerun train --vocab N`; plus the rows' context
    ids, see ContextHead). hidden [..., H] -> logits [..., V]."""
    if "draft_vocab" not in spec.options and isinstance(spec.draft_model, (str, Path)):
        from forerun.heads.checkpoint import read_card

        trained = read_card(spec.draft_model).get("training", {}).get("vocab")
        if trained:
            spec = dataclasses.replace(spec, options={**spec.options, "draft_vocab": trained})
    head = reduced_head(spec, verifier, verifier.model.config.vocab_size)
    return verifier.model.hidden_to_logits if head is None else head


def _like(linear: nn.Linear, dtype: str) -> nn.Module:
    """The sub-head on the path the draft model's own linears take for its dtype."""
    if dtype == "int8":
        from forerun.linears.int8 import Int8Linear

        return Int8Linear(linear)
    if dtype == "int4":
        from forerun.linears.int4 import int4_linear

        return int4_linear(linear)
    from forerun.kernels import loader as kernel_loader

    kernel = kernel_loader.load() if dtype == "float32" else None
    if kernel is not None:
        from forerun.linears.f32 import F32RowsLinear

        return F32RowsLinear(linear, kernel)
    return linear
