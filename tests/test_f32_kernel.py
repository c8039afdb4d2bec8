"""float32 through forerun's kernels: the few-token linear (f32_rows.cpp) computes nn.Linear's
function with one FMA chain per output, so a token's bits never depend on the tokens beside
it; with the per-query chain attention, float32 speculative decoding reproduces float32 plain
decoding bit for bit, and batched rows equal rows run alone."""
import copy
import io

import pytest
import torch

from forerun.kernels.backend import CpuKernels
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.kernels import loader as kernel_loader
from forerun.linears.f32 import F32RowsLinear
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")


@pytest.mark.parametrize("n_in,n_out,bias", [(96, 80, False), (130, 47, True), (512, 1000, True), (3, 200, False)])
def test_the_linear_is_nn_linear_and_per_row(n_in, n_out, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    f = F32RowsLinear(lin, kernel_loader.load())
    x = torch.randn(21, n_in) * torch.rand(21, 1) * 5
    with torch.inference_mode():
        got = f(x)
        assert torch.allclose(got, lin(x), rtol=1e-5, atol=1e-5 * got.abs().max())
        alone = torch.cat([f(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(got, alone)  # 21 rows = 2 token groups + a tail: same bits as 1 row
        assert torch.equal(f(x.view(3, 7, n_in)).view(21, n_out), got)
    assert torch.equal(f.weight, lin.weight.detach())


def test_copy_pickle_and_bfloat16_input():
    torch.manual_seed(0)
    f = F32RowsLinear(torch.nn.Linear(64, 48, bias=True), kernel_loader.load())
    x = torch.randn(5, 64)
    buf = io.BytesIO()
    torch.save(f, buf)
    buf.seek(0)
    with torch.inference_mode():
        ref = f(x)
        for other in (copy.deepcopy(f), torch.load(buf, weights_only=False)):
            assert torch.equal(other(x), ref)
        y = f(x.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max())


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]


@pytest.fixture(scope="module", params=[0, 1, 2])
def verifier(request):
    return LLM(tiny_model(seed=request.param, dtype="float32", hidden_size=64, intermediate_size=128), dtype="float32")


def test_the_float32_model_uses_the_kernels(verifier):
    layer = verifier.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, F32RowsLinear) and isinstance(verifier.model.lm_head, F32RowsLinear)
    backend = verifier.model.backend
    assert isinstance(backend, CpuKernels) and not backend.fused  # per-query attention, torch's norms


@pytest.mark.parametrize("method", ["ngram", "draft_model", "quantized"])
def test_float32_speculative_equals_float32_plain_and_alone(verifier, method):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    assert [verifier.generate([p], greedy, speculative=None)[0].token_ids for p in PROMPTS] == plain
    extra = {"ngram": dict(ngram_max=3), "quantized": {},
             "draft_model": dict(draft_model=LLM(tiny_model(seed=3, dtype="float32", hidden_size=64, intermediate_size=128)))}
    outs = verifier.generate(PROMPTS, greedy, speculative=SpeculativeConfig(method, 5, **extra[method]))
    assert [o.token_ids for o in outs] == plain


def test_a_verify_forward_gives_each_token_its_decode_logits(verifier):
    """The bit-level version: 6 tokens scored in one forward against the same tokens fed
    one by one (plain decoding's forwards), logits equal to the last bit."""
    from forerun.kv.cache import chain_batch

    m = verifier.model
    ids = [(7 * j) % 30 + 1 for j in range(12)]
    with torch.inference_mode():
        cache = m.new_cache(1, 16)
        m(chain_batch([ids[:6]], [0], [0], m.device), cache, logits_at=None)
        together = m(chain_batch([ids[6:]], [6], [0], m.device), cache).logits[0]
        for i in range(6, 12):
            one = m(chain_batch([[ids[i]]], [i], [0], m.device), cache).logits[0, 0]
            assert torch.equal(together[i - 6], one), i


def test_the_state_dict_is_nn_linears():
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 30, bias=True)
    f = F32RowsLinear(lin, kernel_loader.load())
    state = f.state_dict()
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], lin.weight.detach())
    g = F32RowsLinear(torch.nn.Linear(40, 30, bias=True), kernel_loader.load())
    g.load_state_dict(state)
    x = torch.randn(3, 40)
    with torch.inference_mode():
        assert torch.equal(g(x), f(x))
