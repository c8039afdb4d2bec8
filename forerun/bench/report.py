"""The bench's reports in its --out folder: report.md, report.html (plots, verdicts and
outputs coloured by token provenance), the PNG plots, and a browser screenshot of the
HTML page where a headless Chromium is installed."""
from __future__ import annotations

import html
import os
import shutil
import subprocess
from pathlib import Path

from forerun.bench.advise import advise, summary_line
from forerun.bench import plots
from forerun.bench.provenance import Sample, html_css, html_legend, html_sample

PLOTS = {"speedup_by_k.png": plots.speedup_by_k, "acceptance_by_position.png": plots.acceptance_by_position}
COLUMNS = ["workload", "method", "tok/s", "plain tok/s", "speedup (95% CI)", "verdict", "acceptance",
           "tau (predicted)", "accepted by position", "draft / verify / other s", "same as plain"]


def write_reports(result: dict, out: Path) -> dict[str, Path]:
    """Write the plots, report.md and report.html; returns what was written by name."""
    result["advice"] = [a.to_dict() for a in advise(result)]
    written = {}
    if result["cells"]:
        for name, draw in PLOTS.items():
            written[name] = draw(result["cells"], out / name)
    written["report.md"] = out / "report.md"
    written["report.md"].write_text(markdown(result))
    written["report.html"] = out / "report.html"
    written["report.html"].write_text(html_page(result))
    return written


def _row(c: dict) -> list[str]:
    low, high = c["speedup_ci95"]
    ts = c["time_split"]
    pos = " ".join(f"{a:.0%}" for a in c["acceptance_by_position"][:8])
    same = "-" if c["identical"] is None else f"{c['match_share']:.0%}"
    return [c["category"], c["method"], f"{c['tokens_per_s']:.1f}", f"{c['plain_tokens_per_s']:.1f}",
            f"{c['speedup']:.2f}x ({low:.2f}-{high:.2f})", c["verdict"], f"{c['acceptance_rate']:.0%}",
            f"{c['tau']:.2f} ({c['predicted_tau']:.2f})", pos,
            f"{ts['draft_s']:.2f} / {ts['verify_s']:.2f} / {ts['overhead_s']:.2f}", same]


def _advice_lines(result: dict) -> list[str]:
    from forerun.bench.advise import Advice

    adv = [Advice(**a) for a in result.get("advice", [])]
    return [summary_line(adv), ""] + [a.text() for a in adv]


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# forerun bench: {m.get('model')} at {m.get('dtype')}", "",
             f"{m.get('prompts')}, up to {m.get('limit')} prompts per workload, {m.get('max_new_tokens')} new tokens, "
             f"temperature {m.get('temperature')}, {m.get('threads')} threads. Speedup: summed plain wall time / "
             "summed method wall time (prefill included), plain and methods interleaved per prompt; tau: tokens "
             "per verifier forward; predicted: from the per-token acceptance (Leviathan et al.).", "",
             *([f"{result['fidelity'][0].upper()}{result['fidelity'][1:]}.", ""] if result.get("fidelity") else []),
             "## Verdict", "", "```", *_advice_lines(result), "```", "", "## Results", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(c)) + " |" for c in result["cells"]]
    lines += _peers_md(result.get("peers"))
    lines += ["", "## Plots", "", "![speedup by k](speedup_by_k.png)", "", "![acceptance by position](acceptance_by_position.png)"]
    lines += ["", "Sample outputs coloured by token provenance: report.html."]
    if result.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"


def _peers_md(peers: dict | None) -> list[str]:
    if not peers:
        return []
    out = ["", "## Peers", "", "| engine | tok/s | vs forerun plain | same tokens as forerun plain | note |", "|---|---|---|---|---|"]
    for row in peers.get("rows", []):
        tps = f"{row['tokens_per_s']:.1f}" if row.get("tokens_per_s") else "-"
        ratio = f"{row['vs_forerun_plain']:.2f}x" if row.get("vs_forerun_plain") else "-"
        out.append(f"| {row['engine']} | {tps} | {ratio} | {row.get('same_tokens', '-')} | {row.get('note', '')} |")
    out += [f"- skipped: {s}" for s in peers.get("skipped", [])]
    return out


def html_page(result: dict) -> str:
    m = result["meta"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in _row(c)) + "</tr>" for c in result["cells"])
    samples = "".join(html_sample(Sample(s["title"], s["pieces"], s["origins"])) for s in result.get("samples", []))
    peers = "<br>".join(html.escape(line) for line in _peers_md(result.get("peers")) if line)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>forerun bench</title><style>
body {{ font-family: sans-serif; margin: 1.5em; max-width: 1400px; }} table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; }} pre {{ background: #fafafa; padding: 8px; white-space: pre-wrap; }}
img {{ max-width: 100%; }} .sample h4 {{ margin: 0.8em 0 0.2em; }} .share {{ font-size: 12px; color: #555; }}
{html_css()}
</style></head><body>
<h1>forerun bench: {html.escape(str(m.get('model')))} at {html.escape(str(m.get('dtype')))}</h1>
<p>{html.escape(str(m.get('prompts')))}, up to {m.get('limit')} prompts per workload, {m.get('max_new_tokens')} new tokens.</p>
<p>{html.escape(str(result.get('fidelity', '')))}</p>
<h2>Verdict</h2><pre>{html.escape(chr(10).join(_advice_lines(result)))}</pre>
<h2>Results</h2><table><tr>{head}</tr>{rows}</table>
<p>{peers}</p>
<h2>Plots</h2><img src="speedup_by_k.png" alt="speedup by k"><img src="acceptance_by_position.png" alt="acceptance by position">
<h2>Where each token came from</h2><p>{html_legend()}</p>{samples}
</body></html>
"""


def find_chromium() -> str | None:
    """$FORERUN_CHROMIUM, else chromium / chromium-browser / google-chrome on PATH."""
    given = os.environ.get("FORERUN_CHROMIUM")
    if given:
        return given
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 2200, timeout: int = 90) -> Path | None:
    """Render `page` in headless Chromium and save a PNG; None when no Chromium is installed
    (Debian/Ubuntu: apt-get install chromium)."""
    exe = find_chromium()
    if exe is None:
        return None
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={width},{height}",
           f"--screenshot={png.resolve()}", page.resolve().as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
    return png if png.is_file() else None
