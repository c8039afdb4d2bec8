"""Drafters: importing this package registers every built-in method (each module's @register)."""
from forerun.drafters import dflash, draft_model, eagle, layer_skip, lookahead, medusa, ngram, quantized, suffix  # noqa: F401
from forerun.drafters.base import _REGISTRY, Draft, DraftRequest, Drafter, make, register
from forerun.errors import ConfigError

__all__ = ["Draft", "DraftRequest", "Drafter", "available_methods", "build_drafter", "register"]


def build_drafter(name: str, **kwargs) -> Drafter:
    """kwargs: verifier (the LLM), spec (SpeculativeConfig), plus anything a factory needs."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown speculative method {name!r}; available: {available_methods()}")
    return make(name, **kwargs)


def available_methods() -> list[str]:
    """The registered methods (forerun/methods.py describes each)."""
    return sorted(_REGISTRY)
