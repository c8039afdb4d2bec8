"""Drafters: importing this package registers every built-in method."""
from forerun.drafters import draft_model, layer_skip, lookahead, ngram, quantized  # noqa: F401
from forerun.drafters.base import Draft, DraftRequest, Drafter, available_methods, build_drafter, register

__all__ = ["Draft", "DraftRequest", "Drafter", "available_methods", "build_drafter", "register"]
