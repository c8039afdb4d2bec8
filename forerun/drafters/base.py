"""The drafter contract: one protocol for every way of proposing tokens, and a registry.

A drafter sees committed tokens only; it never touches the verifier's cache. Per step
the engine calls `propose` once for the whole batch, then verifies every row in one
verifier forward. Drafters that keep state (a draft model's KV cache) re-sync from
`DraftRequest.tokens`, which always holds the committed sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from forerun.config import SamplingParams
from forerun.kv.cache import KVCache
from forerun.methods import METHODS, Method


@dataclass
class DraftRequest:
    row: int  # the sequence's cache row (stable for the whole generate call)
    tokens: list[int]  # committed prompt + generated tokens; the last has no KV yet
    k: int  # longest draft wanted for this row (0 = none)
    prompt_len: int = 0  # tokens[:prompt_len] is the prompt, the rest was generated
    tenant: bytes = b""  # whose request (the prefix cache's salt): drafters that learn across requests keep tenants apart


@dataclass
class Draft:
    """A chain (parents=None) or a token tree proposed for one row.

    Which acceptance rule is exact depends on how siblings were made, so it is fixed here:
      probs is None  -> deterministic proposals (n-gram matches, top-k expansions): each
                        candidate is a one-hot q; siblings must be distinct tokens and are
                        checked in order against the shrinking residual of p;
      probs given    -> every child of a node was drawn independently from the same q (its
                        row in probs); siblings go through recursive rejection sampling.
    A chain is the one-child-per-node tree, and both rules reduce to the standard one.
    """

    tokens: list[int]  # [n] drafted tokens; for a tree, parents come before children
    probs: torch.Tensor | None = None  # [n, V] q each token was drawn from; None = deterministic
    parents: list[int] | None = None  # [n] parent node index, -1 = the pending token; None = chain
    forced: int = 0  # leading tokens a grammar forces (constrain.py): counted apart from the drafter's

    @classmethod
    def of(cls, tokens: list[int], q_rows: list[torch.Tensor]) -> "Draft":
        """A chain from drafted tokens and the q row each was drawn from (none when greedy)."""
        return cls(tokens, torch.stack(q_rows) if q_rows else None)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def parent_list(self) -> list[int]:
        return list(self.parents) if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    def depth(self) -> int:
        """Longest root-to-leaf path (the most tokens one step can accept)."""
        d = [0] * len(self.tokens)
        for i, p in enumerate(self.parent_list()):
            d[i] = 1 + (d[p] if p >= 0 else 0)
        return max(d, default=0)


@dataclass
class StepFeedback:
    """What one verifier forward saw for a row (for drafters with an `observe` method)."""

    row: int
    pending_pos: int  # position of the pending token that was fed first
    draft: Draft
    argmax: list[int]  # [n + 1] verifier argmax at the pending token (0) and at node i (i + 1)
    accepted: list[int]  # accepted node indices, root to leaf (a chain: 0, 1, ..., n_acc - 1)
    next_token: int  # the recovered or bonus token committed after them


@dataclass
class HiddenRows:
    """The verifier's hidden states at committed positions of one row, for drafters with an
    `observe_hidden` method (Medusa and EAGLE heads read them).

    hidden[i] is the verifier's last hidden state *after* its final norm (what its LM head
    reads) at position start + i, i.e. for input token tokens[start + i]; its logits predict
    tokens[start + i + 1]. Prefill sends positions 0 .. P - 2 of a P-token prompt; each step
    sends the pending token and the accepted path, positions pending_pos .. pending_pos + n.
    So when `propose` runs, a row's hidden states cover positions 0 .. len(tokens) - 2:
    every committed token but the pending one. Example: prompt [a, b, c] -> prefill sends
    h(a), h(b) (start 0); a step that accepts 1 draft token d after pending c and commits
    [d, e] sends h(c), h(d) (start 2), and the next propose sees tokens [a, b, c, d, e].
    """

    row: int
    start: int  # position of hidden[0]
    hidden: torch.Tensor  # [n, hidden_size], a view into the forward's output: copy what you keep


class Drafter(Protocol):
    name: str

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        """A new generate call: num_rows sequences, each at most `capacity` tokens long.

        verifier_cache is the engine's cache; only self-speculative drafters (which run
        the verifier's own layers) write into it, and only past each row's length."""

    def propose(
        self, requests: list[DraftRequest], params: SamplingParams, generator: torch.Generator
    ) -> list[Draft]:
        """One Draft per request, in order. Sample with `generator` only (seeded runs)."""

    # Optional: `max_draft_nodes(k) -> int`, the most tokens one Draft can hold (trees).
    # The engine sizes the KV cache with it; without it a draft holds at most k tokens.
    # Optional: `release(row)`: a new sequence takes `row` mid-run (continuous batching in
    # forerun/serve); a drafter with per-row state forgets that row's. Stateless ones omit it.
    # Optional: `observe(feedback: list[StepFeedback])`, called after each verification
    # (before the accepted tokens are committed), e.g. to update a Jacobi window.
    # Optional: `observe_hidden(rows: list[HiddenRows])`: having it is how a drafter asks for
    # the verifier's hidden states; called after prefill and after each verification.
    # Optional: `observe_prompts([(row, prompt tokens)], salt)`: generate's prefill hands a drafter
    # with its own cache the prompts (timed as prefill; `salt` scopes its prefix cache as the
    # verifier's is scoped); the server's rows feed them lazily (DraftRequest.tenant).
    # Optional: `retire(request: DraftRequest)`: the sequence in request.row ended with
    # request.tokens (k = 0); a draft model keeps its cache's blocks, suffix decoding the output.


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def make(name: str, **kwargs) -> Drafter:
    """The drafter of a registered method (drafters/__init__.build_drafter checks the name first)."""
    return _REGISTRY[name](**kwargs)


def register(name: str, about: str = "a drafter registered at run time"):
    """Decorator: `factory` builds the drafter of method `name` (drafters/__init__.build_drafter
    calls it). A built-in method's line is in forerun/methods.py; another one gets `about`."""

    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        METHODS.setdefault(name, Method("registered", about))
        return factory

    return deco
