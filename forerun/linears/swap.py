"""One walk over a model that swaps its linears, and what the kernel linears share.

Every precision is a swap: int8 (`Int8Linear`), int4 (`Int4Linear` or Q4_K `GGUFLinear`),
the file's own blocks (`GGUFLinear`), float32 on the kernels (`F32RowsLinear`) and back.
`swap_linears(model, make)` visits each child; where `make(child)` returns a module it
takes the child's place (and is not descended into), where it returns None the walk
descends into the child. So a rule is one small function:

    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    >>> _ = swap_linears(m, lambda c: nn.Identity() if isinstance(c, nn.Linear) else None)
    >>> [type(c).__name__ for c in m.modules()][1:]
    ['Identity', 'Sequential', 'ReLU', 'Identity']
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class KernelLinear(Protocol):
    """What Int8Linear, Int4Linear and GGUFLinear share, and what the one-call layer
    (layer_rows.cpp's decoder_layer_rows) and the model's kernel wiring rely on:
    its sizes, a float32 bias or None, the RMSNorm folded into its call (absorb_norm, after
    which `pre_norm` holds that norm) and `kernel_linear`, the compiled call with its
    arguments bound once."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    pre_norm: nn.Module | None
    kernel_linear: object

    def absorb_norm(self, norm: nn.Module) -> bool: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


def swap_linears(model: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """`model` with each child that `make` maps to a module replaced by it, in place (depth first)."""
    for name, child in model.named_children():
        new = make(child)
        if new is None:
            swap_linears(child, make)
        elif new is not child:
            setattr(model, name, new)
    return model


def set_module(model: nn.Module, dotted: str, module: nn.Module) -> None:
    """Put `module` at `dotted` ("model.layers.0.mlp.down_proj") in `model`."""
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
