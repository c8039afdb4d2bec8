"""Quantized self-draft: an int8 copy of the verifier drafts for the float verifier.

Same weights up to rounding, so acceptance is high; the copy is built at load time (no
file, nothing to keep in sync) and drafts through the ordinary draft-model path with its
own KV cache. Pointless, hence refused, when the verifier already runs at int8.
"""
from __future__ import annotations

import copy

from forerun.drafters.base import register
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.errors import ConfigError


def quantized_copy(model, bits: int = 8):
    if bits == 4:
        # Measured (torch 2.13, 2 CPU threads): torch's CPU int4 kernel took 2.7 ms for a
        # 3072x576 one-token matmul vs 0.21 ms float32 and 0.16 ms int8 -- a slower drafter.
        raise ConfigError("an int4 self-draft does not pay on the CPU (torch's int4 kernel is ~13x slower "
                          "than float32 here); use quant_bits=8")
    if bits != 8:
        raise ConfigError(f"quantized self-draft supports 8-bit weights, not {bits}")
    if model.device.type != "cpu":
        raise ConfigError("the int8 self-draft uses CPU kernels (fbgemm); on an accelerator use draft_dtype bfloat16 with draft_model")
    from forerun.models.quant import to_int8_

    draft = copy.deepcopy(model).float()
    return to_int8_(draft).eval().requires_grad_(False)


@register("quantized")
def _make(spec, verifier, **_) -> DraftModelDrafter:
    bits = int(spec.quant_bits)
    if verifier.dtype == "int8" and bits == 8:
        raise ConfigError("the verifier already runs at int8: an int8 self-draft would be the verifier itself; "
                          "use a float32 or bfloat16 verifier, or another method")
    return DraftModelDrafter(quantized_copy(verifier.model, bits), spec.tree_width)
