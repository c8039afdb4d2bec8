"""The advisor: from a bench result, a plain verdict per workload (use speculation or not,
which method, which k) with the measured evidence, and an estimate for other batch sizes.

Verdict rules, per workload, over its cells:
  - among the cells whose 95% interval is above 1, the fastest is recommended ("use");
  - with none, a best cell whose interval straddles 1 is "no measurable gain" (don't use:
    nothing shows it pays), and otherwise every method is slower ("don't use").
  When an adaptive (k = auto) cell is also above 1 and within 5% of the best, it is named as
  the choice that keeps paying when the traffic shifts.

Batch sizes, from the verifier's cost curve ms(T) (one forward scoring T tokens) and the
cell's tau and drafted tokens per step d: B rows decoding plainly score B tokens a step;
speculating, B (1 + d) tokens plus drafting, for tau tokens per row. So
    model(B) = tau * ms(B) / (ms(B (1 + d)) + c * ms(B))
with c the drafter's time per step in plain forwards (assumed to scale like the verifier),
and the estimate is the measured speedup * model(B) / model(1). A forward of T tokens from
one row stands in for T rows of one token (the linears dominate; attention differs).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

BATCHES = (1, 2, 4, 8, 16, 32)


@dataclass
class Advice:
    category: str
    use: bool
    method: str | None  # the recommended cell's label ("ngram k=5"); None: plain decoding
    k: object  # its k (int or "auto")
    speedup: float | None  # the recommended cell's measured speedup (else the best cell's)
    headline: str  # "USE ngram k=5", "DON'T USE", ...
    evidence: list[str] = field(default_factory=list)
    batch_speedup: dict[int, float] = field(default_factory=dict)  # batch size -> estimated speedup

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [f"{self.category}: {self.headline}"] + [f"  - {e}" for e in self.evidence]
        if self.batch_speedup:
            est = ", ".join(f"batch {b}: {s:.2f}x" for b, s in self.batch_speedup.items())
            lines.append(f"  - estimated at other batch sizes (cost curve): {est}")
        return "\n".join(lines)


def advise(result: dict) -> list[Advice]:
    """One Advice per workload of a bench result (its `cells`, optional `cost_curve`)."""
    curve = _curve(result.get("cost_curve"))
    by_cat: dict[str, list[dict]] = {}
    for c in result.get("cells", []):
        if c.get("speedup") is not None:
            by_cat.setdefault(c["category"], []).append(c)
    return [_one(cat, cells, curve) for cat, cells in by_cat.items()]


def _one(category: str, cells: list[dict], curve: dict[int, float] | None) -> Advice:
    proven = [c for c in cells if c["speedup_ci95"][0] > 1.0]  # interval above 1: a measured gain
    best = max(proven or cells, key=lambda c: c["speedup"])
    low, high = best["speedup_ci95"]
    ev = [_evidence(best)]
    if low > 1.0:
        pick = _auto_alternative(cells, best) or best
        a = Advice(category, True, pick["method"], pick["k"], pick["speedup"], f"USE {pick['method']}", ev)
        if pick is not best:
            ev.append(f"k=auto ({pick['method']}) is within 5% of the best fixed k: {_evidence(pick)}; "
                      "it also turns speculation off where acceptance drops")
    elif high >= 1.0:
        a = Advice(category, False, None, 0, best["speedup"], "DON'T USE (no measurable gain)", ev)
        ev.append("the best method's 95% interval includes 1.0: more prompts may show a small gain, or none")
    else:
        a = Advice(category, False, None, 0, best["speedup"], "DON'T USE (every method is slower)", ev)
    ev.extend(_k_hint(best))
    if best.get("identical") is False:
        ev.append(f"outputs differ from plain decoding on {1 - best['match_share']:.0%} of prompts "
                  "(expected only at bfloat16, or int8 token trees)")
    if low > 0 and high / low > 2:
        ev.append(f"the interval is very wide ({low:.2f}-{high:.2f}x): a stall hit some runs, or the prompts differ "
                  "widely; rerun on a quiet machine or with more prompts before trusting the figure")
    if best["n_prompts"] < 3:
        a.headline += f" (tentative: {best['n_prompts']} prompt{'s' if best['n_prompts'] > 1 else ''}, too few for a real interval)"
    if curve and a.use:
        a.batch_speedup = batch_estimates(best, curve)
    return a


def _evidence(c: dict) -> str:
    low, high = c["speedup_ci95"]
    return (f"{c['method']}: {c['speedup']:.2f}x plain (95% CI {low:.2f}-{high:.2f}, {c['n_prompts']} prompts), "
            f"{c['tokens_per_s']:.1f} vs {c['plain_tokens_per_s']:.1f} tok/s, acceptance {c['acceptance_rate']:.0%}, "
            f"tau {c['tau']:.2f} (predicted {c['predicted_tau']:.2f})")


def _auto_alternative(cells: list[dict], best: dict) -> dict | None:
    autos = [c for c in cells if c["k"] == "auto" and c["speedup_ci95"][0] > 1.0]
    auto = max(autos, key=lambda c: c["speedup"], default=None)
    return auto if auto is not None and auto is not best and auto["speedup"] >= 0.95 * best["speedup"] else None


def _k_hint(c: dict) -> list[str]:
    """Where acceptance by position falls under 30%: positions past it are mostly wasted."""
    pos = c.get("acceptance_by_position") or []
    low = next((i for i, a in enumerate(pos) if a < 0.3), None)
    if low is None or c["k"] == "auto" or low + 1 >= len(pos):
        return []
    shown = ", ".join(f"{a:.0%}" for a in pos)
    return [f"acceptance by draft position {shown}: position {low + 1} onwards is kept under 30% of the time; "
            f"compare a shorter k (e.g. {max(1, low + 1)}) or k=auto"]


def batch_estimates(cell: dict, curve: dict[int, float], batches=BATCHES) -> dict[int, float]:
    """Estimated speedup at each batch size (module docstring); batches whose speculative
    forward would exceed twice the longest measured forward are left out."""
    d, tau = cell["drafted_per_step"], cell["tau"]
    ts, ps = cell["time_split"], cell["plain_time_split"]
    plain_step = (ps["verify_s"] + ps["overhead_s"]) / max(1, cell["plain_steps"])
    c = (ts["draft_s"] / max(1, cell["steps"])) / plain_step if plain_step > 0 else 0.0
    top = max(curve)

    def model(b: int) -> float:
        return tau * interp(curve, b) / (interp(curve, b * (1 + d)) + c * interp(curve, b))

    base = model(1)
    return {b: round(cell["speedup"] * model(b) / base, 3) for b in batches if b * (1 + d) <= 2 * top}


def interp(curve: dict[int, float], t: float) -> float:
    """ms at t tokens: linear between measured points, linear past the last two.
    >>> interp({1: 10.0, 3: 20.0}, 2), interp({1: 10.0, 3: 20.0}, 5)
    (15.0, 30.0)
    """
    xs = sorted(curve)
    if t <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if t <= b:
            return curve[a] + (curve[b] - curve[a]) * (t - a) / (b - a)
    a, b = xs[-2:] if len(xs) > 1 else (xs[0], xs[0])
    slope = (curve[b] - curve[a]) / (b - a) if b != a else 0.0
    return curve[b] + slope * (t - b)


def _curve(raw) -> dict[int, float] | None:
    """The measured curve made non-decreasing (scoring more tokens never costs less: a dip
    is timing noise, and would read as a gain from batching)."""
    if not raw or not raw.get("ms"):
        return None
    curve, top = {}, 0.0
    for t, ms in sorted((int(t), float(ms)) for t, ms in raw["ms"].items()):
        top = max(top, ms)
        curve[t] = top
    return curve


def summary_line(advice: list[Advice]) -> str:
    used = [a for a in advice if a.use]
    if not used:
        return "Verdict: do not turn speculative decoding on for this traffic: no workload gained measurably."
    names = ", ".join(f"{a.category} ({a.method}, {a.speedup:.2f}x)" for a in used)
    rest = [a.category for a in advice if not a.use]
    return f"Verdict: turn it on for {names}" + (f"; leave it off for {', '.join(rest)}." if rest else ".")
