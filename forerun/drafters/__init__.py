"""Drafters: importing this package registers every built-in method."""
from forerun.drafters import dflash, draft_model, eagle, layer_skip, lookahead, medusa, ngram, quantized  # noqa: F401
from forerun.drafters.base import Draft, DraftRequest, Drafter, available_methods, build_drafter, register

__all__ = ["Draft", "DraftRequest", "Drafter", "available_methods", "build_drafter", "register"]
