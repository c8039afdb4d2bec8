"""The bench's HTML report in a real headless browser (Debian's chromium): the page renders,
the screenshot lands in the report folder, and accepted draft tokens show in their colour."""
import pytest

from forerun.bench.report import find_chromium, screenshot, write_reports
from forerun.bench.provenance import ORIGINS
from tests.test_bench import cell


def synthetic_result() -> dict:
    cells = [cell("code", "ngram k=3", 3, 1.4, 1.2, 1.6), cell("code", "ngram k=5", 5, 1.3, 1.1, 1.5),
             cell("chat", "ngram k=3", 3, 0.9, 0.8, 1.0)]
    pieces = ["def", " fib", "(n", "):", "\n   ", " return", " n", " if", " n", " <", " 2", " else", " fib", "(n", "-1", ")"]
    samples = [{"category": "code", "method": "ngram k=3", "title": "code / ngram k=3 / HumanEval/0",
                "pieces": pieces * 3, "origins": "paaabaarpaaaaaab" * 3}]
    return {"meta": {"model": "tiny", "dtype": "float32", "prompts": "synthetic", "limit": 5, "max_new_tokens": 64},
            "cells": cells, "samples": samples, "warnings": []}


@pytest.mark.skipif(find_chromium() is None, reason="no headless Chromium here (Debian: apt-get install chromium, "
                    "or set FORERUN_CHROMIUM to a Chrome/Chromium binary)")
def test_html_report_renders_in_chromium(tmp_path):
    written = write_reports(synthetic_result(), tmp_path)
    png = screenshot(written["report.html"], tmp_path / "report-screenshot.png", width=1200, height=1600)
    assert png is not None and png.parent == tmp_path and png.stat().st_size > 20_000
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(png))[..., :3] * 255).round().astype(int)
    green = tuple(int(ORIGINS["a"][2][i:i + 2], 16) for i in (1, 3, 5))  # the accepted-draft background
    red = tuple(int(ORIGINS["r"][2][i:i + 2], 16) for i in (1, 3, 5))
    for colour in (green, red):
        hits = ((abs(pixels - colour)).sum(-1) <= 6).sum()
        assert hits > 200, f"colour {colour} not drawn ({hits} pixels)"
