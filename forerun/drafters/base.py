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
from forerun.errors import ConfigError


@dataclass
class DraftRequest:
    row: int  # the sequence's cache row (stable for the whole generate call)
    tokens: list[int]  # committed prompt + generated tokens; the last has no KV yet
    k: int  # longest draft wanted for this row (0 = none)


@dataclass
class Draft:
    tokens: list[int]  # [k_b] proposed continuation, k_b <= request.k (may be empty)
    probs: torch.Tensor | None = None  # [k_b, V] q the tokens were drawn from; None = one-hot


class Drafter(Protocol):
    name: str

    def start(self, num_rows: int, capacity: int) -> None:
        """A new generate call: num_rows sequences, each at most `capacity` tokens long."""

    def propose(
        self, requests: list[DraftRequest], params: SamplingParams, generator: torch.Generator
    ) -> list[Draft]:
        """One Draft per request, in order. Sample with `generator` only (seeded runs)."""


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(name: str):
    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def build_drafter(name: str, **kwargs) -> Drafter:
    """kwargs: verifier (the LLM), spec (SpeculativeConfig), plus anything a factory needs."""
    from forerun import drafters  # noqa: F401  (importing the package registers the drafters)

    if name not in _REGISTRY:
        raise ConfigError(f"unknown speculative method {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def available_methods() -> list[str]:
    from forerun import drafters  # noqa: F401

    return sorted(_REGISTRY)
