"""The draw itself (sampling.sample / sample_many): every token at its probability, never one
of probability zero, bad rows refused."""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from forerun.sampling import sample, sample_many


def _chi2(draws: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert counts[~support].sum() == 0, "drew a token of probability zero"
    share = probs[support].double()
    expected = share / share.sum() * draws.numel()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("scale", [1.0, 37.5])  # rows need not be normalised (residuals are not)
def test_draws_follow_the_row_and_skip_zeros(scale):
    probs = torch.tensor([0.0, 0.42, 0.0, 0.3, 0.2, 0.05, 0.0, 0.029, 0.001, 0.0]) * scale
    g = torch.Generator().manual_seed(0)
    draws = sample_many(probs[None], 40_000, g)[0]
    assert _chi2(draws, probs) > 1e-3


def test_each_row_its_own_distribution_and_the_wide_vocabulary():
    """Rows are independent; a 151,936-wide row with a few thousand ids of mass (Qwen's width)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.zeros(151_936)
    hot = torch.randperm(151_936, generator=g)[:3000]
    wide[hot] = torch.rand(3000, generator=g) ** 4  # skewed masses, some tiny
    narrow = torch.zeros(151_936)
    narrow[[5, 151_935]] = torch.tensor([0.25, 0.75])  # the very last id can be drawn
    draws = sample_many(torch.stack([wide, narrow]), 20_000, g)
    assert set(draws[1].tolist()) == {5, 151_935}
    assert _chi2(draws[1], narrow) > 1e-3
    assert torch.isin(draws[0], hot).all()
    top = wide.topk(8).indices  # the most likely ids, pooled against the rest: their shares agree
    counts = torch.tensor([(draws[0] == t).sum() for t in top] + [(~torch.isin(draws[0], top)).sum()]).double()
    w = wide.double()
    expected = torch.cat([w[top], w.sum()[None] - w[top].sum()]) / w.sum() * draws.shape[1]
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_sample_is_one_draw_a_row_and_seeded():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(2)), -1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.shape == (4,) and a.dtype == torch.long and torch.equal(a, b)


@pytest.mark.parametrize(
    "row",
    [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [0.5, float("inf"), 0.1], [0.7, -0.2, 0.5]],
    ids=["all-zero", "nan", "inf", "negative"],
)
def test_bad_rows_are_refused(row):
    with pytest.raises(ValueError, match="probabilities"):
        sample(torch.tensor([[0.2, 0.3, 0.5], row]), None)


def test_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample_many(torch.ones(2, 3, 4), 1, None)


def test_argmax_matches_torch_on_ties_nan_and_inf():
    from forerun.sampling import argmax
    g = torch.Generator().manual_seed(3)
    for V in (151936, 49152, 1000, 32768 + 5):
        x = torch.randn(2, 5, V, generator=g)
        x[0, 1, [7, V - 3]] = 50.0  # a tie: the first wins
        x[0, 2, [V // 2, 11]] = float("nan")  # NaN counts as the largest, the first one
        x[1, 0] = float("-inf")  # all equal
        x[1, 1, V - 1] = float("inf")
        x[1, 2] = 0.0
        x[0, 3, [V - 2, V - 1]] = 60.0  # a tie at the end
        x[0, 4, [V - 2, V - 1]] = float("nan")
        x[1, 3, [V - 1, 5]] = float("nan")
        assert torch.equal(argmax(x), x.argmax(-1)), V
        assert torch.equal(argmax(x[0, 0]), x[0, 0].argmax(-1))  # one row, no batch dims
        assert torch.equal(argmax(x.double()), x.double().argmax(-1))
        assert torch.equal(argmax(x.transpose(0, 1)), x.transpose(0, 1).argmax(-1))  # strided rows
        assert torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(-1))  # no numpy dtype: torch's own
    assert argmax(torch.empty(0, 151936)).shape == (0,)
