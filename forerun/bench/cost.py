"""`forerun cost`'s plot of the verifier's cost curve (measured by forerun/cost_curve.py)."""
from __future__ import annotations

import torch

from forerun.cost_curve import CostCurve


def plot(curves: list[CostCurve], path: str) -> str:
    """cost(T) / cost(1) per curve, with the ideal (flat) and the compute-bound (T) lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max(max(c.ms) for c in curves)
    for c in curves:
        xs = sorted(c.ms)
        ax.plot(xs, [c.ratio(x) for x in xs], marker="o", label=f"{c.model} {c.dtype} ({c.ms[1]:.0f} ms at 1)")
    ax.plot([1, top], [1, 1], ls=":", c="grey", label="memory-bound ideal")
    ax.plot([1, top], [1, top], ls="--", c="lightgrey", label="compute-bound (cost ∝ T)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.8, max(2.5, max(c.ratio(max(c.ms)) for c in curves) * 1.1))
    ax.set_xlabel("tokens scored in one forward (k + 1)")
    ax.set_ylabel("forward time / one-token forward time")
    ax.set_title(f"verifier cost curve ({torch.get_num_threads()} threads, context {curves[0].context})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
