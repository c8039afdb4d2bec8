"""`forerun cost`: the cost curve's measurement and plot on a tiny model (no timing asserted:
only that every size is measured, positive, and drawn)."""
import pytest

from forerun.bench.cost import plot
from forerun.cost_curve import CostCurve, measure
from forerun.cli import main
from tests.tiny import tiny_model


def test_every_size_is_measured_and_drawn(tmp_path):
    model = tiny_model(seed=0, dtype="float32")
    ms = measure(model, [1, 3, 8], context=20, repeats=2)
    assert sorted(ms) == [1, 3, 8] and all(v > 0 for v in ms.values())
    curve = CostCurve("tiny", "float32", 20, ms)
    assert curve.ratio(1) == 1.0
    path = plot([curve, CostCurve("tiny", "int8", 20, {1: 2.0, 3: 2.2, 8: 3.0})], str(tmp_path / "cost.png"))
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["cost", "--tokens", "0,2"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
