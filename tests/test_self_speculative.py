"""Training-free drafters that need only the verifier: layer_skip, early_exit, quantized,
lookahead. Each gets greedy identity, a chi-square test through generate, and its refusals."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
SPECS = {
    "layer_skip": lambda k: SpeculativeConfig("layer_skip", k, skip_layers=(1, 2)),
    "early_exit": lambda k: SpeculativeConfig("early_exit", k, exit_layer=2),
    "quantized": lambda k: SpeculativeConfig("quantized", k),
    "quantized_int4": lambda k: SpeculativeConfig("quantized", k, quant_bits=4),
    "lookahead": lambda k: SpeculativeConfig("lookahead", k, lookahead_window=4, lookahead_ngram=3, lookahead_pool=3),
}


@pytest.fixture(scope="module")
def verifier():
    # float32: the int8 self-draft quantises from float32 weights
    return LLM(tiny_model(seed=0, num_hidden_layers=4, dtype="float32"), dtype="float32")


@pytest.fixture(scope="module")
def plain(verifier):
    return [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_identity(verifier, plain, method, k):
    outs = verifier.generate(PROMPTS, GREEDY, speculative=SPECS[method](k))
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    assert st.drafted > 0 and st.accepted > 0


def test_lookahead_drafts_inside_the_verifier_forward(verifier):
    """No model call of its own: forwards = prefill + one per step."""
    calls = {"n": 0}
    hook = verifier.model.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    try:
        out = verifier.generate([PROMPTS[0]], GREEDY, speculative=SPECS["lookahead"](5))[0]
    finally:
        hook.remove()
    assert calls["n"] == 1 + out.stats.verifier_forwards
    assert out.stats.verifier_forwards < len(out.token_ids)  # it did accept drafted tokens


STAT_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
N = 12_000


@pytest.fixture(scope="module")
def small_vocab():
    return LLM(tiny_model(seed=0, vocab_size=8, num_hidden_layers=4, dtype="float32"), dtype="float32")


@pytest.mark.parametrize("method", list(SPECS))
def test_sampling_is_exact(small_vocab, method):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=21)
    reference = joint_distribution(small_vocab.model, STAT_PROMPT, params, n=4)
    outs = small_vocab.generate([STAT_PROMPT] * N, params, speculative=SPECS[method](2))
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0, st
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3


def test_refusals(verifier):
    with pytest.raises(ConfigError, match="already runs at int8"):
        LLM(tiny_model(dtype="float32"), dtype="int8").generate([[1, 2]], GREEDY, speculative=SPECS["quantized"](2))
    with pytest.raises(ConfigError, match="quant_bits 8 .* or 4"):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("quantized", 2, quant_bits=3))
    with pytest.raises(ConfigError, match="tune-skip"):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("layer_skip", 2))
    with pytest.raises(ConfigError, match="proper subset"):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("layer_skip", 2, skip_layers=(0, 1, 2, 3)))
    with pytest.raises(ConfigError, match="exit_layer"):
        verifier.generate([[1, 2]], GREEDY, speculative=SpeculativeConfig("early_exit", 2, exit_layer=4))


def test_layer_skip_leaves_committed_cache_entries_alone(verifier):
    """Drafting writes only past each row's length: a speculative run's cache over the
    committed tokens equals a plain run's."""
    from forerun.engine import GenerateJob, generate

    def cache_after(spec):
        caches = []
        orig = verifier.model.new_cache
        verifier.model.new_cache = lambda *a: caches.append(orig(*a)) or caches[-1]
        try:
            job = GenerateJob([PROMPTS[0]], GREEDY, [20], eos_ids=frozenset())
            if spec is not None:
                job.drafter = verifier.drafter_for(spec)
                job.k = spec.num_speculative_tokens
            seq = generate(verifier.model, job)[0]
        finally:
            verifier.model.new_cache = orig
        n = len(seq.tokens) - 1
        return caches[0], n

    (a, n), (b, m) = cache_after(None), cache_after(SPECS["layer_skip"](3))
    assert n == m
    for layer in range(4):
        torch.testing.assert_close(a.k[layer][0, :, :n], b.k[layer][0, :, :n])
