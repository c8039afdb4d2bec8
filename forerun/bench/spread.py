"""How sure a speedup is: a bootstrap interval over prompts (or repeats), a plain verdict,
and a note when other work was competing for the CPU. One timed pair on a shared machine
cannot carry a speedup claim; these say how far the figure can be trusted."""
from __future__ import annotations

import os
import random


def ratio_interval(plain: list[float], spec: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of sum(plain) / sum(spec), resampling the paired runs.
    >>> ratio_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    (2.0, 2.0)
    """
    if len(plain) != len(spec) or not plain:
        raise ValueError("need paired, non-empty timings")
    rng = random.Random(seed)
    n, ratios = len(plain), []
    for _ in range(rounds):
        idx = [rng.randrange(n) for _ in range(n)]
        s = sum(spec[i] for i in idx)
        ratios.append(sum(plain[i] for i in idx) / s if s > 0 else float("inf"))
    ratios.sort()
    return ratios[int(0.025 * rounds)], ratios[min(rounds - 1, int(0.975 * rounds))]


def verdict(low: float, high: float) -> str:
    """ "faster" / "slower" when the whole interval is on one side of 1, else "within noise".
    >>> verdict(1.1, 1.4), verdict(0.8, 1.2), verdict(0.7, 0.9)
    ('faster', 'within noise', 'slower')
    """
    return "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"


def busy_note(own_threads: int = 0) -> str | None:
    """A warning when, besides this process's own `own_threads` compute threads, the 1-minute
    load reaches half the CPUs: other work was competing with the benchmark just now, and
    its ratios are unreliable. (Call it at the end of a run; the load lags by about a minute.)"""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cpus = os.cpu_count() or 1
    if load - own_threads >= cpus / 2:
        return (f"the machine is busy (1-minute load {load:.1f} on {cpus} CPUs, {own_threads} of it this run): "
                "timings and ratios are unreliable")
    return None
