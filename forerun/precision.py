"""A precision, resolved once: the user's `dtype` string ("auto", "gguf", "int8", ...) turned
into what computes the model and where, by `LLM` (models/loader.py: resolve_precision), then
passed down as this value instead of a bare string resolved again on the way.

    >>> p = Precision("gguf", "cpu", kernels=True, gguf_blocks=True)
    >>> str(p), p.batch_invariant, p.float_dtype
    ('gguf', True, torch.float32)
    >>> Precision("float32", "cpu", kernels=False, gguf_blocks=False).batch_invariant
    False
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
QUANTIZED = ("gguf", "int8", "int4")  # the CPU kernels' own precisions


@dataclass(frozen=True)
class Precision:
    name: str  # "gguf", "int8", "int4", "float32", "bfloat16", "float64" (never "auto")
    device: str  # torch's device string: "cpu", "cuda", ...
    kernels: bool  # forerun's compiled CPU kernels loaded here (kernels/loader.py)
    gguf_blocks: bool  # the model's folder came from a GGUF whose matrices the kernels read as they are

    def __str__(self) -> str:
        return self.name

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of the float tensors (activations, norms, the KV cache): float32 for the
        quantized precisions."""
        return FLOAT_DTYPES.get(self.name, torch.float32)

    @property
    def on_cpu(self) -> bool:
        return torch.device(self.device).type == "cpu"

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's bits never depend on what else a forward computes (the kernels'
        per-token linears and per-query attention): gguf, int8, int4 and float32 on the kernels."""
        return self.kernels and self.on_cpu and self.name in (*QUANTIZED, "float32")

    @property
    def from_blocks(self) -> bool:
        """int8 / int4 / gguf built straight from the file's blocks (no float32 copy written)."""
        return self.name in QUANTIZED and self.gguf_blocks
