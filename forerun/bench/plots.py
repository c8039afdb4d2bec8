"""The bench's PNG plots: speedup by k per workload, acceptance by draft position."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _base(label: str) -> str:
    """'ngram k=5' -> 'ngram'."""
    return label.rsplit(" k=", 1)[0]


def speedup_by_k(cells: list[dict], path: Path) -> Path:
    """One panel per workload: speedup (with its 95% interval) against k, a line per method;
    k = auto is drawn as a horizontal dashed line in the method's colour."""
    plt = _plt()
    cats = sorted({c["category"] for c in cells})
    fig, axes = plt.subplots(1, len(cats), figsize=(4.2 * len(cats), 3.6), squeeze=False, sharey=True)
    colours = {}
    for ax, cat in zip(axes[0], cats):
        mine = [c for c in cells if c["category"] == cat]
        for base in sorted({_base(c["method"]) for c in mine}):
            colour = colours.setdefault(base, f"C{len(colours)}")
            fixed = sorted((c for c in mine if _base(c["method"]) == base and c["k"] != "auto"), key=lambda c: c["k"])
            if fixed:
                ks = [c["k"] for c in fixed]
                ys = [c["speedup"] for c in fixed]
                err = [[y - c["speedup_ci95"][0] for y, c in zip(ys, fixed)], [c["speedup_ci95"][1] - y for y, c in zip(ys, fixed)]]
                ax.errorbar(ks, ys, yerr=err, marker="o", capsize=3, color=colour, label=base)
            for c in mine:
                if _base(c["method"]) == base and c["k"] == "auto":
                    ax.axhline(c["speedup"], ls="--", color=colour, label=f"{base} k=auto")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(sorted({c["k"] for c in mine if c["k"] != "auto"}) or [0])
        ax.set_title(cat)
        ax.set_xlabel("k (draft tokens per step)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup over plain decoding")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_by_position(cells: list[dict], path: Path) -> Path:
    """One panel per workload: share of drafts reaching position i whose token i was kept."""
    plt = _plt()
    cats = sorted({c["category"] for c in cells})
    fig, axes = plt.subplots(1, len(cats), figsize=(4.2 * len(cats), 3.6), squeeze=False, sharey=True)
    for ax, cat in zip(axes[0], cats):
        for c in (c for c in cells if c["category"] == cat and c["acceptance_by_position"]):
            pos = c["acceptance_by_position"]
            ax.plot(range(1, len(pos) + 1), pos, marker=".", label=c["method"])
        ax.set_title(cat)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accepted share")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
