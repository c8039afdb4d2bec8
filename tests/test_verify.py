"""Table tests for the acceptance math (verify.py) and probability shaping (sampling.py)."""
import pytest
import torch

from forerun.config import SamplingParams
from forerun.sampling import logits_to_probs, make_generator
from forerun.verify import greedy_verify, rejection_verify

V = 5


def onehot_logits(rows: list[list[int]]) -> torch.Tensor:
    """[B, T, V] logits whose argmax at each position is the given token."""
    return torch.nn.functional.one_hot(torch.tensor(rows), V).double() * 10


@pytest.mark.parametrize(
    "draft, lens, best, accepted, nxt",
    [
        ([[1, 2, 3]], [3], [[1, 2, 3, 4]], [3], [4]),  # perfect match: bonus = argmax after the draft
        ([[1, 2, 3]], [3], [[0, 2, 3, 4]], [0], [0]),  # first token wrong: recovered immediately
        ([[1, 2, 3]], [3], [[1, 2, 0, 4]], [2], [0]),  # late mismatch
        ([[0, 0, 0]], [0], [[3, 1, 1, 1]], [0], [3]),  # empty draft: plain decoding step
        ([[1, 2, 3], [1, 4, 0]], [3, 1], [[1, 2, 3, 4], [1, 4, 0, 2]], [3, 1], [4, 4]),  # padding never accepted
    ],
)
def test_greedy_table(draft, lens, best, accepted, nxt):
    r = greedy_verify(torch.tensor(draft), torch.tensor(lens), onehot_logits(best))
    assert r.num_accepted.tolist() == accepted
    assert r.next_token.tolist() == nxt


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_rejection_certain_accept_then_bonus_from_p():
    p = _probs([[[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]]])  # [1, K+1=3, V]
    q = _probs([[[0, 1, 0, 0, 0], [0, 0, 1, 0, 0]]])
    r = rejection_verify(torch.tensor([[1, 2]]), torch.tensor([2]), q, p, make_generator(0, torch.device("cpu")))
    assert (r.num_accepted.item(), r.next_token.item()) == (2, 4)


def test_rejection_certain_reject_samples_residual():
    # p puts no mass on the drafted token 1: always rejected; residual = p (q's mass is on 1 only).
    p = _probs([[[0, 0, 0, 1, 0], [0.2] * 5]])
    q = _probs([[[0, 1, 0, 0, 0]]])
    for seed in range(20):
        r = rejection_verify(torch.tensor([[1]]), torch.tensor([1]), q, p, make_generator(seed, torch.device("cpu")))
        assert (r.num_accepted.item(), r.next_token.item()) == (0, 3)


def test_one_hot_draft_residual_excludes_the_drafted_token():
    """q=None means a deterministic proposal; on rejection x itself can never be resampled."""
    p = _probs([[[0.5, 0.5, 0, 0, 0], [0.2] * 5]])
    seen = {0: 0, 1: 0}
    accepted = 0
    for seed in range(400):
        r = rejection_verify(torch.tensor([[0]]), torch.tensor([1]), None, p, make_generator(seed, torch.device("cpu")))
        if r.num_accepted.item() == 0:
            seen[r.next_token.item()] += 1
        else:
            accepted += 1
    assert seen[0] == 0 and seen[1] > 100 and 150 < accepted < 250


def test_accept_probability_is_p_over_q():
    """q(x)=0.8, p(x)=0.2 -> accepted 25% of the time."""
    p = _probs([[[0.2, 0.8, 0, 0, 0], [0.2] * 5]])
    q = _probs([[[0.8, 0.2, 0, 0, 0]]])
    B = 20000
    r = rejection_verify(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, dtype=torch.long),
                         q.expand(B, -1, -1), p.expand(B, -1, -1), make_generator(1, torch.device("cpu")))
    rate = r.num_accepted.double().mean().item()
    assert abs(rate - 0.25) < 0.015
    # rejected rows resample from norm(max(0, p - q)) = token 1 only
    assert set(r.next_token[r.num_accepted == 0].tolist()) == {1}


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0], dtype=torch.float64))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert p.tolist() == [1.0, 0.0, 0.0]  # never empty


def test_top_k_and_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    p = logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    e = torch.exp(torch.tensor([4.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(p, torch.cat([e / e.sum(), torch.zeros(2, dtype=torch.float64)]))
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [1.0, 0.0, 0.0, 0.0]
