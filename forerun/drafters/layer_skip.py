"""Self-speculative drafting (Zhang et al. 2023, "Draft & Verify"): the verifier drafts
with some of its own layers skipped. No second model, no second cache.

Why sharing the cache is safe: every committed token's K/V was written by a full
verifier forward. A draft forward writes its (lower quality) K/V only at slots from the
pending token onwards, in the layers it runs; the verification forward then rewrites
exactly those slots in every layer before any committed token could read them.
Early exit is the special case skip = {N, ..., L - 1}.
"""
from __future__ import annotations

import torch

from forerun.config import SamplingParams
from forerun.drafters.base import Draft, DraftRequest, register
from forerun.errors import ConfigError
from forerun.kv.cache import KVCache, chain_batch
from forerun.sampling import draw


class LayerSkipDrafter:
    name = "layer_skip"

    def __init__(self, model, skip: frozenset[int]):
        n = model.config.num_hidden_layers
        if not skip or any(not 0 <= i < n for i in skip) or len(skip) >= n:
            raise ConfigError(f"skip set must be a non-empty proper subset of layers 0..{n - 1}, got {sorted(skip)}")
        self.model, self.skip = model, frozenset(skip)
        self.cache: KVCache | None = None

    def start(self, num_rows: int, capacity: int, verifier_cache: KVCache) -> None:
        self.cache = verifier_cache

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], params: SamplingParams, generator) -> list[Draft]:
        live = [r for r in requests if r.k > 0]
        tokens = {r.row: [] for r in live}
        probs = {r.row: [] for r in live}
        feed = [r.tokens[-1] for r in live]
        pos = [len(r.tokens) - 1 for r in live]
        for step in range(max((r.k for r in live), default=0)):
            batch = chain_batch([[t] for t in feed], pos, [r.row for r in live], self.model.device)
            logits = self.model(batch, self.cache, skip=self.skip).logits[:, 0]  # [B, V]
            picked, q = draw(logits, params, generator)
            for i, r in enumerate(live):
                tokens[r.row].append(picked[i])
                if q is not None:
                    probs[r.row].append(q[i])
            keep = [i for i, r in enumerate(live) if r.k > step + 1]
            live, feed, pos = [live[i] for i in keep], [picked[i] for i in keep], [pos[i] + 1 for i in keep]
        return [Draft.of(tokens[r.row], probs[r.row]) if r.k > 0 else Draft([]) for r in requests]


@register("layer_skip")
def _make_layer_skip(spec, verifier, **_) -> LayerSkipDrafter:
    from forerun.drafters.skip_profile import load_skip_set

    skip = spec.skip_layers if spec.skip_layers is not None else load_skip_set(verifier)
    return LayerSkipDrafter(verifier.model, frozenset(skip))


@register("early_exit")
def _make_early_exit(spec, verifier, **_) -> LayerSkipDrafter:
    n = verifier.model.config.num_hidden_layers
    exit_at = spec.exit_layer if spec.exit_layer is not None else n // 2
    if not 1 <= exit_at < n:
        raise ConfigError(f"exit_layer must be in [1, {n - 1}], got {exit_at}")
    return LayerSkipDrafter(verifier.model, frozenset(range(exit_at, n)))
