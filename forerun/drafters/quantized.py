"""Quantized self-draft: a lower-bit copy of the verifier drafts for it.

Same weights up to rounding, so acceptance is high; the copy is built at load time (no
file, nothing to keep in sync) and drafts through the ordinary draft-model path with its
own KV cache. `quant_bits` 8 gives an int8 copy (for a float verifier), 4 an int4 copy
(4.5 bits a weight: for a float32 or int8 verifier). A copy at the verifier's own
precision would be the verifier itself, and is refused.
"""
from __future__ import annotations

import copy

from forerun.drafters.base import register
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.errors import ConfigError

BITS_DTYPE = {8: "int8", 4: "int4"}


def quantized_copy(model, bits: int = 8):
    if bits not in BITS_DTYPE:
        raise ConfigError(f"quantized self-draft supports quant_bits 8 (int8) or 4 (int4), not {bits}")
    if model.device.type != "cpu":
        raise ConfigError("the quantized self-draft uses CPU kernels; on an accelerator use draft_dtype bfloat16 with draft_model")
    draft = copy.deepcopy(model)
    if bits == 8:
        from forerun.linears.int8 import to_int8_

        return to_int8_(draft.float()).eval().requires_grad_(False)
    from forerun.linears.int4 import to_int4_

    try:
        return to_int4_(draft.float()).eval().requires_grad_(False)
    except RuntimeError as e:  # no compiled kernel here
        raise ConfigError(str(e)) from None


@register("quantized")
def _make(spec, verifier, **_) -> DraftModelDrafter:
    bits = int(spec.quant_bits)
    if verifier.dtype == "gguf":
        raise ConfigError("the verifier already computes with its GGUF file's quantized blocks: an int8 / int4 self-draft "
                          "would cost about what it costs; use draft_model (e.g. a smaller GGUF), ngram or lookahead")
    if verifier.dtype == BITS_DTYPE.get(bits) or (verifier.dtype == "int4" and bits == 8):
        raise ConfigError(f"the verifier already runs at {verifier.dtype}: a {BITS_DTYPE.get(bits)} self-draft would be "
                          "the verifier itself or dearer; use a float32 verifier (or int8 with quant_bits 4), or another method")
    p_min = float(spec.options.get("draft_p_min", 0.0))
    return DraftModelDrafter(quantized_copy(verifier.model, bits), spec.tree_width, p_min=p_min)
