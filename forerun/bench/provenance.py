"""Where each generated token came from, drawn for people: the terminal (rich) and HTML.

The engine writes one letter per generated token into `SpecStats.origins`:
    a  accepted draft token (the drafter proposed it, the verifier kept it)
    r  recovered token (the verifier's own pick where it refused a draft token)
    b  bonus token (the verifier's next token after a fully accepted draft)
    p  plain token (a step that drafted nothing)
Every step ends in exactly one r, b or p, so the share of "a" letters is the share of the
output the drafter wrote, and a run of a's then b is a draft accepted whole.

>>> spans(["x", "y", "z"], "aab")
[('xy', 'a'), ('z', 'b')]
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Callable

ORIGINS = {  # letter -> (label, terminal style, HTML colour)
    "a": ("accepted draft", "black on green3", "#9be49b"),
    "r": ("recovered (draft refused)", "white on red3", "#f28b82"),
    "b": ("bonus (draft accepted whole)", "black on gold1", "#ffd54f"),
    "p": ("plain (nothing drafted)", "default", "transparent"),
}


@dataclass
class Sample:
    """One output shown by provenance: the text pieces per token and their origin letters."""

    title: str
    pieces: list[str]  # [n] decoded text each token adds
    origins: str  # [n] letters, see the module docstring

    def to_dict(self) -> dict:
        return {"title": self.title, "pieces": self.pieces, "origins": self.origins}


def token_pieces(decode: Callable[[list[int]], str], ids: list[int]) -> list[str]:
    """The text each token adds, decoding growing prefixes (a multi-byte character shows on
    the token that completes it). Quadratic in len(ids): meant for a few hundred tokens."""
    pieces, prev = [], ""
    for i in range(len(ids)):
        text = decode(ids[: i + 1])
        pieces.append(text[len(prev):] if text.startswith(prev) else text)
        prev = text
    return pieces


def spans(pieces: list[str], origins: str) -> list[tuple[str, str]]:
    """Consecutive tokens of the same origin joined: [(text, letter)]."""
    out: list[tuple[str, str]] = []
    for piece, o in zip(pieces, origins):
        if out and out[-1][1] == o:
            out[-1] = (out[-1][0] + piece, o)
        else:
            out.append((piece, o))
    return out


def shares(origins: str) -> dict[str, float]:
    """Share of tokens per origin letter."""
    n = len(origins) or 1
    return {o: origins.count(o) / n for o in ORIGINS}


def render_terminal(sample: Sample, console=None) -> None:
    """Print the sample coloured by origin, then a legend with each origin's share."""
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    text = Text()
    for piece, o in spans(sample.pieces, sample.origins):
        text.append(piece, style=ORIGINS[o][1])
    console.print(text)
    legend = Text("legend: ")
    for o, share in shares(sample.origins).items():
        legend.append(f" {ORIGINS[o][0]} {share:.0%} ", style=ORIGINS[o][1])
        legend.append(" ")
    console.print(legend)


def html_legend() -> str:
    return " ".join(f'<span class="tok o-{o}">{html.escape(label)}</span>' for o, (label, _, _) in ORIGINS.items())


def html_css() -> str:
    rules = [f".o-{o} {{ background: {colour}; }}" for o, (_, _, colour) in ORIGINS.items()]
    return "\n".join([".tok { border-radius: 3px; padding: 0 1px; white-space: pre-wrap; }", *rules])


def html_sample(sample: Sample) -> str:
    """One sample as an HTML block: each same-origin run a coloured span (title = origin)."""
    body = "".join(
        f'<span class="tok o-{o}" title="{ORIGINS[o][0]}">{html.escape(text)}</span>'
        for text, o in spans(sample.pieces, sample.origins)
    )
    share = ", ".join(f"{ORIGINS[o][0]} {v:.0%}" for o, v in shares(sample.origins).items() if v)
    return (f'<div class="sample"><h4>{html.escape(sample.title)}</h4>'
            f'<pre class="out">{body}</pre><p class="share">{html.escape(share)}</p></div>')
