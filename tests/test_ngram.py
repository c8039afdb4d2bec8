from forerun.drafters.base import DraftRequest
from forerun.drafters.ngram import NgramDrafter, find_continuation


def test_longest_match_first_then_most_recent():
    toks = [7, 1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3]
    # "1 2 3" matches at index 1 (n=3) -> continuation 9 9 ...
    assert find_continuation(toks, 3, 1, 2) == [9, 9]
    # n=2 only: "2 3" last seen at index 6 -> 4 5
    assert find_continuation(toks, 2, 2, 2) == [4, 5]


def test_no_match_and_limits():
    assert find_continuation([1, 2, 3, 4], 3, 1, 5) == []
    assert find_continuation([1, 1], 2, 1, 5) == [1]  # continuation stops at the end of the text
    assert find_continuation([5, 6, 5], 2, 1, 0) == []
    assert find_continuation([5], 2, 1, 3) == []


def _per_n_scans(tokens, n_max, n_min, k, branches):
    """The search as it was first written: one sliding-window scan per n, longest n first,
    most recent match first, distinct continuations."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    if k <= 0 or len(tokens) < 2:
        return []
    arr, found = np.asarray(tokens), []
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        for hit in np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[-n:]).all(axis=1))[::-1]:
            cont = arr[hit + n : hit + n + k].tolist()
            if cont not in found:
                found.append(cont)
            if len(found) == branches:
                return found
    return found


def test_one_scan_finds_what_a_scan_per_n_finds():
    import random

    from forerun.drafters.ngram import find_continuations

    rng = random.Random(0)
    for _ in range(3000):
        toks = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 40))]
        n_max = rng.randrange(1, 6)
        n_min, k, branches = rng.randrange(1, n_max + 1), rng.randrange(0, 5), rng.randrange(1, 4)
        case = (toks, n_max, n_min, k)
        assert find_continuation(*case) == (_per_n_scans(*case, 1) or [[]])[0], case
        assert find_continuations(*case, branches) == _per_n_scans(*case, branches), (case, branches)


def test_drafter_respects_per_request_k():
    d = NgramDrafter(3, 1)
    out = d.propose([DraftRequest(0, [1, 2, 3, 1, 2], 2), DraftRequest(1, [1, 2, 3, 1, 2], 0)], None, None)
    assert out[0].tokens == [3, 1] and out[0].probs is None
    assert out[1].tokens == []
