"""int8 linears: the kernel computes the documented function (per-channel int8 weights, int8
activations with one scale per group of 64 inputs), a token's bits never depend on its
batch-mates for any number of tokens, and the result is close to the float32 layer."""
import pytest
import torch

from forerun.kernels import loader as kernel_loader

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="int8 needs the compiled kernels")

from forerun.kernels.backend import WIDE_ROWS  # noqa: E402
from forerun.linears.int8 import GROUP, Int8Linear  # noqa: E402


def _layer(n_in=96, n_out=80, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    return lin, Int8Linear(lin)


def group_quantized(x: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float64 [N, K]: the activations int8 and int4 compute with, a[k] =
    round(x[k] * (127 / amax_g)) times amax_g / 127 per group g of 64 inputs (0 for a zero group)."""
    N, K = x.shape
    Kp = -(-K // GROUP) * GROUP
    groups = torch.nn.functional.pad(x, (0, Kp - K)).view(N, Kp // GROUP, GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    a = torch.where(amax > 0, torch.round(groups * (127 / amax)), 0.0)
    return (a.double() * (amax.double() / 127)).view(N, Kp)[:, :K]


def reference(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 of the documented function: group_quantized activations times the int8 weights
    and their per-channel scales."""
    if q.pre_norm is not None:
        x = q.pre_norm(x)
    y = (group_quantized(x) @ q.weight_int8.double().T) * q.weight_scale.double()
    return y if q.bias is None else y + q.bias.double()


def _rows(n, width=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g) * 4  # very different ranges


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [2, 63, 64, 65, 130, 896])
def test_the_kernel_computes_the_documented_function(bias, width):
    _, q = _layer(n_in=width, n_out=53, bias=bias)
    x = _rows(11, width)
    x[3, : min(width, 64)] = 0.0  # an all-zero group: scale 0, no NaN
    with torch.inference_mode():
        y = q(x)
    ref = reference(q, x)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_rows_get_the_same_bits_alone_and_in_any_batch():
    """Every tile size (1-4 tokens a pass, several passes for more), ragged tails and prefill
    widths: a row's bits never depend on the rows beside it."""
    _, q = _layer(n_in=200, n_out=100, bias=True)
    x = _rows(2 * WIDE_ROWS + 5, 200)
    with torch.inference_mode():
        together = q(x)
        for i in range(0, len(x), 7):
            assert torch.equal(q(x[i : i + 1]), together[i : i + 1])
        for a, b in [(0, 2), (2, 5), (5, 9), (1, 17), (3, 80)]:
            assert torch.equal(q(x[a:b]), together[a:b])
        assert torch.equal(q(x.view(7, 19, 200)).view(-1, 100), together)


def test_close_to_the_float_layer():
    lin, q = _layer(n_in=256, n_out=128, bias=True)
    x = torch.randn(5, 3, 256)
    with torch.inference_mode():
        ref, got = lin(x), q(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).norm() / ref.norm()
    assert err < 0.01, err  # 8-bit weights, 8-bit activations per group: about 0.5% here


def test_one_large_channel_no_longer_flattens_the_token():
    """The reason for per-group scales: with one outlier 100x the rest, a per-token scale
    would leave the other groups a few levels; per group they keep 8 bits."""
    lin, q = _layer(n_in=256, n_out=64)
    x = torch.randn(1, 256)
    x[0, :GROUP] = 0.0
    x[0, 5] = 100.0  # alone in its group: a per-token scale would give the others steps of 0.8
    with torch.inference_mode():
        exact = x.double() @ q.weight.double().T  # the int8 weights, the activations unquantized
        err = (q(x).double() - exact).abs().max()
        rest = (x[0, GROUP:].double() @ q.weight[:, GROUP:].double().T).abs().max()
    assert err < 0.01 * rest, (err, rest)


def test_zero_input_gives_bias_not_nan():
    _, q = _layer(bias=True)
    with torch.inference_mode():
        assert torch.equal(q(torch.zeros(1, 96)), q.bias[None])


def test_a_folded_rms_norm_computes_linear_of_norm():
    """absorb_norm: the kernel runs the RMSNorm itself, per token, on every size."""
    from forerun.models.llama import RMSNorm

    lin, q = _layer(bias=True)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = _rows(2 * WIDE_ROWS)
    with torch.inference_mode():
        unfolded = q(norm(x))
        assert q.absorb_norm(norm)
        folded = q(x)
        few = torch.cat([q(x[i : i + 1]) for i in range(8)])
        assert torch.equal(folded[:8], few)  # per token
        assert torch.allclose(folded, unfolded, rtol=0.02, atol=0.02 * unfolded.abs().max())
        ref = lin(norm(x))
        assert ((folded - ref).norm() / ref.norm()) < 0.02


def test_copy_and_pickle_rebuild_the_kernels():
    """The kernel's weight copy is an opaque layout: deepcopy / torch.save must rebuild it
    from the int8 weights, with the same outputs."""
    import copy
    import io

    _, q = _layer(bias=True)
    x = _rows(2 * WIDE_ROWS)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.inference_mode():
        for other in (copy.deepcopy(q), loaded):
            for n in (1, 2 * WIDE_ROWS):
                assert torch.equal(other(x[:n]), q(x[:n]))


def test_other_dtypes_and_grad_modes():
    """bfloat16 input is computed in float32 and returned as bfloat16; no_grad as inference."""
    _, q = _layer()
    x = _rows(3)
    with torch.inference_mode():
        ref = q(x)
    with torch.no_grad():
        assert torch.equal(q(x), ref)
        y = q(x.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max())


def test_the_float_weights_are_what_it_computes_with():
    _, q = _layer(n_in=70, n_out=9)
    assert torch.equal(q.weight, q.weight_int8.float() * q.weight_scale[:, None])
    assert q.weight_int8.abs().max() <= 127
