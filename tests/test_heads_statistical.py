"""Sampling through Medusa and EAGLE heads keeps the verifier's law: chi-square of 12k
four-token samples (the prefill's, then steps drafting up to two) against the exact joint distribution (tests/stats_util.py), for the
chain with q (rejection sampling), Medusa's tree of i.i.d. draws (recursive rejection
sampling), EAGLE-2's deterministic tree (the one-hot sibling rule), and a chain whose q
covers a reduced draft vocabulary."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.heads.checkpoint import new_head
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model

N = 12_000
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
PARAMS = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=21)
SHAPES = {
    "chain": dict(tree_width=1),
    "tree": dict(tree_width=2, options={"tree_nodes": 4, "tree_beam": 2}),
    "chain-reduced-vocab": dict(tree_width=1, options={"draft_vocab": 5}),  # q is 0 on ids 5..7
}


@pytest.fixture(scope="module")
def verifier():
    return LLM(tiny_model(seed=0, vocab_size=8))


@pytest.fixture(scope="module")
def reference(verifier):
    return joint_distribution(verifier.model, PROMPT, PARAMS, n=4)


def _head(method, verifier):
    head = new_head(method, verifier.model, **({} if method == "eagle" else {"num_heads": 2}))
    torch.manual_seed(2)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.double()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash"])
def test_sampling_is_exact(verifier, reference, method, shape):
    spec = SpeculativeConfig(method, 2, draft_model=_head(method, verifier), **SHAPES[shape])
    outs = verifier.generate([PROMPT] * N, PARAMS, speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0 and st.bonus > 0, st
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3
