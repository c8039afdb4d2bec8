"""A precision, resolved once: the user's `dtype` string ("auto", "gguf", "int8", ...) turned
into what computes the model and where, by `LLM` (models/loader.py: resolve_precision), then
passed down as this value instead of a bare string resolved again on the way.

    >>> p = Precision("gguf", "cpu", kernels=True, gguf_blocks=True)
    >>> str(p), p.batch_invariant, p.float_dtype
    ('gguf', True, torch.float32)
    >>> Precision("float32", "cpu", kernels=False, gguf_blocks=False).batch_invariant
    False

The KV cache's dtype rides along (`kv_cache`, LLM's kv_cache_dtype): "auto" keeps the
activations' dtype; "float16" halves the cache over float32 activations, rounding every K/V
element to float16 (lossy, and batch-invariant like the float32 cache: the kernels widen
what they read exactly, kernels/attention_rows.cpp).

    >>> p = Precision("gguf", "cpu", kernels=True, gguf_blocks=True, kv_cache="float16")
    >>> p.kv_dtype, Precision("bfloat16", "cuda", kernels=False, gguf_blocks=False).kv_dtype
    (torch.float16, torch.bfloat16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.errors import ConfigError

FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
QUANTIZED = ("gguf", "int8", "int4")  # the CPU kernels' own precisions
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # kv_cache_dtype's choices besides "auto"


@dataclass(frozen=True)
class Precision:
    name: str  # "gguf", "int8", "int4", "float32", "bfloat16", "float64" (never "auto")
    device: str  # torch's device string: "cpu", "cuda", ...
    kernels: bool  # forerun's compiled CPU kernels loaded here (kernels/loader.py)
    gguf_blocks: bool  # the model's folder came from a GGUF whose matrices the kernels read as they are
    kv_cache: str = "auto"  # the KV cache's dtype: "auto" (float_dtype), "float32", "float16" (lossy)

    def __post_init__(self):
        kv_dtype_for(self.kv_cache, self.float_dtype)  # a choice these activations cannot take fails here

    def __str__(self) -> str:
        return self.name

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of the float tensors (activations, norms, the KV cache): float32 for the
        quantized precisions."""
        return FLOAT_DTYPES.get(self.name, torch.float32)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV cache's keys and values (models/base.py: new_cache)."""
        return kv_dtype_for(self.kv_cache, self.float_dtype)

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


def kv_dtype_for(kv_cache: str, float_dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype that `kv_cache` ("auto", "float32", "float16") names over activations of
    `float_dtype`. A 16-bit cache is float32 activations' option only: bfloat16 and float64
    models keep a cache of their own dtype ("auto").

    >>> kv_dtype_for("auto", torch.float32), kv_dtype_for("float16", torch.float32)
    (torch.float32, torch.float16)
    >>> kv_dtype_for("float16", torch.bfloat16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forerun.errors.ConfigError: kv_cache_dtype float16 needs float32 activations (dtype gguf, int8, ...
    """
    if kv_cache == "auto":
        return float_dtype
    if kv_cache not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be 'auto', {', '.join(map(repr, KV_CACHE_DTYPES))}; got {kv_cache!r}")
    dtype = KV_CACHE_DTYPES[kv_cache]
    if dtype != float_dtype and float_dtype != torch.float32:
        raise ConfigError(f"kv_cache_dtype {kv_cache} needs float32 activations (dtype gguf, int8, int4 or float32); "
                          f"{float_dtype} models keep a cache of their own dtype ('auto')")
    return dtype


def follow_kv_cache(kv_cache: str, dtype: str) -> str:
    """Another model's kv_cache choice for a model at `dtype` (a dtype string, "auto" included):
    kept where that model computes in float32 (a draft model beside its verifier), else "auto".

    >>> follow_kv_cache("float16", "int4"), follow_kv_cache("float16", "auto"), follow_kv_cache("float16", "bfloat16")
    ('float16', 'float16', 'auto')
    """
    return kv_cache if FLOAT_DTYPES.get(dtype, torch.float32) == torch.float32 else "auto"
