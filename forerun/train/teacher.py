"""The verifier as teacher: its hidden states over the training chunks, teacher-forced, and
its LM head as a plain differentiable function (every target distribution is
softmax(lm_head(hidden)), recomputed from the stored hidden states when needed).

Hidden states are stored as float16 (half of bfloat16's rounding error at the same size)
in DIR/features.safetensors with the chunks they belong to, keyed by the chunks, the
verifier's fingerprint and precision: `--resume` and reruns on the same data skip the
verifier pass, which is most of a small run's time on a CPU.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from forerun.cache import write_atomic
from forerun.kv.cache import chain_batch

FEATURES = "features.safetensors"


@torch.inference_mode()
def hidden_states(model, chunks: torch.Tensor, rows_per_forward: int = 4, progress=None) -> torch.Tensor:
    """[n, T] token chunks -> [n, T, H] float16 hidden states (after the final norm)."""
    n, T = chunks.shape
    out = torch.empty(n, T, model.config.hidden_size, dtype=torch.float16)
    for i in range(0, n, rows_per_forward):
        rows = chunks[i : i + rows_per_forward].tolist()
        batch = chain_batch(rows, [0] * len(rows), list(range(len(rows))), model.device)
        h = model(batch, model.new_cache(len(rows), T), logits_at=None).hidden
        out[i : i + len(rows)] = h.float().clamp(-65000, 65000).to(torch.float16).cpu()
        if progress is not None:
            progress(len(rows))
    return out


def cached_hidden_states(folder: Path, model, chunks: torch.Tensor, key_extra: str, progress=None) -> torch.Tensor:
    """hidden_states, read from folder/features.safetensors when it was computed for the
    same chunks and verifier (key_extra: its fingerprint and precision), else computed and saved."""
    from safetensors.torch import load_file, safe_open, save_file

    key = hashlib.sha256(chunks.numpy().tobytes() + key_extra.encode()).hexdigest()
    path = folder / FEATURES
    if path.exists():
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("key") == key:
                return load_file(str(path))["hidden"]
    hidden = hidden_states(model, chunks, progress=progress)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: save_file({"hidden": hidden}, str(tmp), metadata={"key": key}))
    return hidden


def lm_head_function(model, kept: torch.Tensor | None = None):
    """h [..., H] (float32) -> the verifier's logits [..., V] float32, differentiable in h: its LM
    head's float weights (dequantised for int8 / int4), Gemma's soft-capping included.
    kept: ids [n] to score instead of all V (logits [..., n]: the loss and accuracy then
    compare distributions renormalised over those ids, what a draft_vocab drafter proposes)."""
    from forerun.drafters.draft_vocab import float_rows

    V = model.config.vocab_size
    ids = torch.arange(V, device=model.device) if kept is None else kept.to(model.device)
    W = float_rows(model.lm_head, ids).float().detach()  # [V or n, H]
    cap = getattr(model.config, "final_logit_softcapping", None)

    def logits(h: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.linear(h, W).float()  # (the product may run under autocast; the losses read float32)
        return cap * torch.tanh(z / cap) if cap else z

    return logits
