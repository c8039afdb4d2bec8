"""What a serve-matrix cell says, and the tables: greedy identity of a load run against the
same prompts run alone, and the Markdown the matrix prints and writes.

A cell is a dict: engine, config, clients, loadgen's summary (tok_per_s, p50_s, p95_s,
ttft_p50_s, ...), identity (from `identity`), kv_before / kv_peak / kv_after / kv_total (KV
blocks in use before, at the peak of and after the load, of the pool; None for llama-server) and acceptance
(accepted / drafted during the load; None when nothing was drafted or it is not reported).
"""
from __future__ import annotations


def first_difference(a: str, b: str) -> int:
    """The first character index where a and b differ (len of the shorter when one is a prefix).

    >>> first_difference("abcd", "abXd"), first_difference("ab", "abc")
    (2, 2)
    """
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identity(records: list[dict], alone: dict[int, str]) -> dict:
    """How many records' texts equal the text of their prompt (`prompt`, an index) run alone,
    and where each other one first parts from it.

    >>> identity([{"prompt": 0, "text": "ab"}, {"prompt": 1, "text": "xz"}], {0: "ab", 1: "xy"})
    {'same': 1, 'of': 2, 'differ': [{'prompt': 1, 'at_char': 1}]}
    """
    differ = [{"prompt": r["prompt"], "at_char": first_difference(r["text"], alone[r["prompt"]])}
              for r in records if r["text"] != alone[r["prompt"]]]
    return {"same": len(records) - len(differ), "of": len(records), "differ": differ}


def label(cell: dict) -> str:
    return f"{cell['engine']} {cell['config']}"


def kv_text(cell: dict) -> str:
    if cell.get("kv_total") is None:
        return "n/a"
    return f"{cell['kv_before']} / {cell['kv_peak']} / {cell['kv_after']} of {cell['kv_total']}"


def _acceptance(cell: dict) -> str:
    return "" if cell.get("acceptance") is None else f"{100 * cell['acceptance']:.0f}%"


def detail_table(cells: list[dict]) -> str:
    """One row per cell, every figure."""
    lines = ["| server | clients | tok/s | p50 s | p95 s | TTFT p50 s | identical to alone | KV blocks before / peak / after | acceptance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        same = f"{c['identity']['same']}/{c['identity']['of']}"
        lines.append(f"| {label(c)} | {c['clients']} | {c['tok_per_s']:.1f} | {c['p50_s']:.2f} | {c['p95_s']:.2f} | "
                     f"{c['ttft_p50_s']:.2f} | {same} | {kv_text(c)} | {_acceptance(c)} |")
    return "\n".join(lines)


def throughput_table(cells: list[dict]) -> str:
    """Clients down, servers across: tok/s (p50 / p95 latency in s), a blank where a cell is missing.

    >>> cell = dict(engine="forerun", config="off", clients=1, tok_per_s=17.55, p50_s=1.6, p95_s=1.9)
    >>> print(throughput_table([cell]))
    | clients | forerun off |
    |---|---|
    | 1 | 17.6 (1.60 / 1.90) |
    """
    servers = list(dict.fromkeys(label(c) for c in cells))
    by = {(label(c), c["clients"]): c for c in cells}
    lines = ["| clients | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    for n in sorted({c["clients"] for c in cells}):
        row = [by.get((s, n)) for s in servers]
        lines.append(f"| {n} | " + " | ".join(f"{c['tok_per_s']:.1f} ({c['p50_s']:.2f} / {c['p95_s']:.2f})" if c else ""
                                               for c in row) + " |")
    return "\n".join(lines)


def markdown(cells: list[dict], title: str) -> str:
    return (f"## {title}\n\ntokens/s (p50 / p95 request latency in s):\n\n{throughput_table(cells)}\n\n"
            f"Every cell:\n\n{detail_table(cells)}\n")
