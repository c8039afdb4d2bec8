"""`forerun drift`: does a drafter still pay after the verifier changed?

A drafter is fitted to one verifier (a draft model distilled from it, a layer-skip set tuned
on it, n-gram habits of its outputs). When the verifier is updated, re-quantised or
fine-tuned, acceptance can fall and a drafter that paid can cost time. This runs the same
prompts, plain and speculative, under both verifier versions and flags each workload:

  stopped paying       speedup was > 1 under the old verifier and is now < 1
  acceptance fell      acceptance dropped by more than `drop` (relative) and 5 points
  ok                   neither
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class DriftFlag:
    category: str
    status: str  # "stopped paying", "acceptance fell", "ok"
    old_speedup: float
    new_speedup: float
    old_acceptance: float
    new_acceptance: float
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def compare(old: list[dict], new: list[dict], drop: float = 0.2) -> list[DriftFlag]:
    """Pair the bench cells of both verifiers by workload and method; flag each pair."""
    new_by = {(c["category"], c["method"]): c for c in new}
    flags = []
    for o in old:
        n = new_by.get((o["category"], o["method"]))
        if n is None:
            continue
        flags.append(_flag(o, n, drop))
    return flags


def _flag(o: dict, n: dict, drop: float) -> DriftFlag:
    a0, a1, s0, s1 = o["acceptance_rate"], n["acceptance_rate"], o["speedup"], n["speedup"]
    fell = a1 < a0 * (1 - drop) and a0 - a1 > 0.05
    where = f"{o['category']} / {o['method']} ({o['n_prompts']} prompts; 95% CI old {_ci(o)}, new {_ci(n)})"
    if s0 > 1.0 and s1 < 1.0:
        status = "stopped paying"
        msg = (f"WARNING: {where} no longer pays: {s0:.2f}x -> {s1:.2f}x plain decoding "
               f"(acceptance {a0:.0%} -> {a1:.0%}); re-fit or switch off this drafter for the new verifier")
    elif fell:
        status = "acceptance fell"
        msg = (f"warning: {where}: acceptance fell {a0:.0%} -> {a1:.0%} (speedup {s0:.2f}x -> {s1:.2f}x); "
               "the drafter fits the new verifier less well")
    else:
        status = "ok"
        msg = f"{where}: ok (speedup {s0:.2f}x -> {s1:.2f}x, acceptance {a0:.0%} -> {a1:.0%})"
    return DriftFlag(o["category"], status, s0, s1, a0, a1, msg)


def _ci(c: dict) -> str:
    low, high = c.get("speedup_ci95") or (float("nan"), float("nan"))
    return f"{low:.2f}-{high:.2f}x"


@torch.no_grad()
def perturb_(model: torch.nn.Module, sigma: float, seed: int = 0) -> torch.nn.Module:
    """Add Gaussian noise of `sigma` x each weight matrix's own std to every floating
    weight of 2+ dimensions (float32 kernels' packed weights included): a stand-in for a
    fine-tuned new version of the verifier. Integer (int8) weights are left alone, so
    perturb a float model and quantise it afterwards, or compare precisions instead."""
    g = torch.Generator().manual_seed(seed)
    touched = 0
    named = list(model.named_parameters()) + list(model.named_buffers())
    from forerun.linears.gguf import GGUFEmbedding, GGUFLinear

    # int4's groups of 64 and GGUF blocks (gguf, int4's Q4_K form) are held packed, not as buffers
    packed = any(hasattr(m, "u4_rows") or isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())
    if packed or any(t.dtype in (torch.int8, torch.uint8) for _, t in named):
        raise ValueError("an int8/int4/gguf model's weights cannot be perturbed: perturb a float model, "
                         "or compare precisions (--new-dtype)")
    for name, t in named:
        if name.endswith(("weight", "weight_packed")) and t.is_floating_point() and t.dim() >= 2:
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
            t.add_(noise * t.float().std().to(t.dtype) * sigma)
            touched += 1
    if not touched:
        raise ValueError("no floating-point weight matrices to perturb")
    return model


def report_lines(flags: list[DriftFlag]) -> list[str]:
    lines = [f.message for f in flags]
    bad = [f for f in flags if f.status == "stopped paying"]
    lines.append(f"drift: {len(bad)} of {len(flags)} workloads stopped paying under the new verifier"
                 if bad else f"drift: the drafter still pays or holds on all {len(flags)} workloads")
    return lines
