"""The loss curve of a training run (PNG): training loss (a running mean), held-out loss,
and held-out draft accuracy on a second axis."""
from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, _running_mean(losses, max(1, len(losses) // 50)), label="training loss (running mean)", lw=1)
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="held-out loss")
        acc = ax.twinx()
        acc.plot([e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "s--", color="tab:green",
                 label="held-out draft accuracy")
        acc.set_ylabel("top-1 agreement with the verifier")
        acc.set_ylim(0, 1)
        acc.legend(loc="center right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _running_mean(xs, w: int) -> list[float]:
    """The mean of the last w values at each point.
    >>> _running_mean([1, 3, 5], 2)
    [1.0, 2.0, 4.0]
    """
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= w:
            total -= xs[i - w]
        out.append(total / min(i + 1, w))
    return out
