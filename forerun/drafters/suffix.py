"""Suffix decoding (`method="suffix"`): drafts from what followed the sequence's tail in its
own text (prompt and output so far) and in earlier requests' outputs of the same tenant,
at no model cost (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM's `suffix` method).

Agents repeat themselves across requests (the same file re-emitted with a small edit, the
same tool-call skeletons), which prompt lookup, seeing one request only, cannot catch.

Tenants: an earlier request's output drafts only for requests of the same tenant (the
server's API key and `cache_salt`, DraftRequest.tenant), so one tenant's text is never
proposed in another's session. The store holds at most `max_requests` outputs in all,
oldest out first (`--suffix-cache-requests`).

Hybrid (`draft_model=` given): a row whose best suffix tree scores at least `min_score`
(expected accepted tokens, suffix_tree.py) drafts from it; the other rows ask the draft
model. The choice reads committed tokens only, before anything is drawn, so sampled
output keeps the verifier's distribution.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np

from forerun.drafters.base import Draft, DraftRequest, make, register
from forerun.drafters.suffix_tree import SEP, Candidate, SuffixRule, best_candidate
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache


class SuffixStore:
    """Earlier requests' outputs by tenant, one haystack per tenant (texts joined by SEP)."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self._texts: OrderedDict[int, tuple[bytes, np.ndarray]] = OrderedDict()  # oldest first
        self._hay: dict[bytes, np.ndarray] = {}  # tenant -> haystack, rebuilt after a change
        self._next = 0

    def __len__(self) -> int:
        return len(self._texts)

    def add(self, tenant: bytes, tokens: list[int]) -> None:
        if self.max_requests <= 0 or not tokens:
            return
        self._texts[self._next] = (tenant, np.asarray(tokens, dtype=np.int64))
        self._next += 1
        self._hay.pop(tenant, None)
        while len(self._texts) > self.max_requests:
            _, (old, _) = self._texts.popitem(last=False)
            self._hay.pop(old, None)

    def hay(self, tenant: bytes) -> np.ndarray:
        """The tenant's outputs, oldest first, each followed by SEP (empty: none kept)."""
        if tenant not in self._hay:
            parts = []
            for t, arr in self._texts.values():
                if t == tenant:
                    parts += [arr, np.array([SEP], dtype=np.int64)]
            self._hay[tenant] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._hay[tenant]

    def reset(self) -> int:
        n = len(self._texts)
        self._texts.clear()
        self._hay.clear()
        return n


class SuffixDrafter:
    name = "suffix"

    def __init__(self, rule: SuffixRule = SuffixRule(), max_requests: int = 256, fallback=None,
                 min_score: float = 1.0):
        self.rule, self.store = rule, SuffixStore(max_requests)
        self.fallback, self.min_score = fallback, min_score  # hybrid: the draft model, for low scores
        self.suffix_drafts = self.fallback_drafts = 0  # rows drafted by each (hybrid's split)

    @property
    def drafts_after_forced(self) -> bool:
        """Drafts from tokens alone (no draft model): it may continue a grammar's forced run."""
        return self.fallback is None

    def max_draft_nodes(self, k: int) -> int:
        inner = getattr(self.fallback, "max_draft_nodes", lambda k: k)(k) if self.fallback else k
        return max(k, inner)

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        if self.fallback is not None:
            self.fallback.start(num_rows, capacity, verifier_cache)

    def candidate(self, r: DraftRequest) -> Candidate:
        """The better tree of this sequence's own text and its tenant's earlier outputs."""
        if r.k <= 0 or len(r.tokens) < 2:
            return Candidate.empty()
        seq = np.asarray(r.tokens, dtype=np.int64)
        own = best_candidate(seq, seq, r.k, self.rule, search_end=len(seq) - 1)
        hay = self.store.hay(r.tenant)
        if not len(hay):
            return own
        earlier = best_candidate(hay, seq, r.k, self.rule)
        return earlier if earlier.score > own.score else own

    def propose(self, requests: list[DraftRequest], params, generator) -> list[Draft]:
        cands = [self.candidate(r) for r in requests]
        drafts = [_draft(c) for c in cands]
        if self.fallback is not None:
            weak = [i for i, (r, c) in enumerate(zip(requests, cands)) if r.k > 0 and c.score < self.min_score]
            if weak:
                for i, d in zip(weak, self.fallback.propose([requests[i] for i in weak], params, generator)):
                    drafts[i] = d
            self.fallback_drafts += len(weak)
            self.suffix_drafts += sum(1 for r in requests if r.k > 0) - len(weak)
        return drafts

    def retire(self, r: DraftRequest) -> None:
        """The sequence ended: its output joins its tenant's store."""
        self.store.add(r.tenant, r.tokens[r.prompt_len :])
        if self.fallback is not None and hasattr(self.fallback, "retire"):
            self.fallback.retire(r)

    # -- a hybrid's draft model: its per-row state and its prompt feed --------------------
    def release(self, row: int) -> None:
        if self.fallback is not None and hasattr(self.fallback, "release"):
            self.fallback.release(row)

    def observe_prompts(self, prompts: list[tuple[int, list[int]]], salt: bytes = b"") -> None:
        if self.fallback is not None and hasattr(self.fallback, "observe_prompts"):
            self.fallback.observe_prompts(prompts, salt)

    def observe_prefix(self, items: list[tuple[int, list[int], int, bytes]]) -> None:
        if self.fallback is not None and hasattr(self.fallback, "observe_prefix"):
            self.fallback.observe_prefix(items)

    def unfed(self, row: int, tokens: list[int]) -> int:
        return self.fallback.unfed(row, tokens) if hasattr(self.fallback, "unfed") else 0

    @property
    def fed_tokens(self) -> int:
        return getattr(self.fallback, "fed_tokens", 0)

    @property
    def catch_up_seconds(self) -> float:
        return getattr(self.fallback, "catch_up_seconds", 0.0)

    @property
    def prompt_seconds(self) -> float:
        return getattr(self.fallback, "prompt_seconds", 0.0)


def _draft(c: Candidate) -> Draft:
    """A chain where the tree has one branch (the cheaper step), else the tree; one-hot q."""
    if c.parents == list(range(-1, len(c.tokens) - 1)):
        return Draft(c.tokens)
    return Draft(c.tokens, None, c.parents)


def rule_from(options: dict) -> SuffixRule:
    """SuffixRule from SpeculativeConfig.options (suffix_max_match, suffix_factor, suffix_min_prob)."""
    rule = SuffixRule(int(options.get("suffix_max_match", SuffixRule.max_match)),
                      float(options.get("suffix_factor", SuffixRule.factor)),
                      float(options.get("suffix_min_prob", SuffixRule.min_prob)))
    if rule.max_match < 1 or not rule.factor > 0 or not 0.0 <= rule.min_prob <= 1.0:
        raise ConfigError(f"suffix options need suffix_max_match >= 1, suffix_factor > 0 and 0 <= suffix_min_prob <= 1, "
                          f"got {rule.max_match}, {rule.factor}, {rule.min_prob}")
    return rule


@register("suffix")
def _make(spec, verifier, **_) -> SuffixDrafter:
    requests = spec.options.get("suffix_cache_requests", 256)
    if not isinstance(requests, int) or isinstance(requests, bool) or requests < 0:
        raise ConfigError(f"options['suffix_cache_requests'] must be an integer >= 0, got {requests!r}")
    min_score = spec.options.get("suffix_min_score", 1.0)
    if isinstance(min_score, bool) or not isinstance(min_score, (int, float)) or not 0 <= min_score < float("inf"):
        raise ConfigError(f"options['suffix_min_score'] must be a finite number >= 0 (the expected accepted tokens a "
                          f"suffix draft needs before the draft model is skipped), got {min_score!r}")
    fallback = None
    if spec.draft_model is not None:  # hybrid: the draft model drafts where no suffix tree is confident
        fallback = make("draft_model", spec=replace(spec, method="draft_model"), verifier=verifier)
    return SuffixDrafter(rule_from(spec.options), requests, fallback, min_score)
