"""int8 linears: per-token results independent of batch-mates, both GEMM kernels giving the
same bits, and close to the float32 layer they replace."""
import pytest
import torch

from forerun.models.quant import WIDE_ROWS, Int8Linear


def _layer(n_in=96, n_out=80, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    return lin, Int8Linear(lin)


@pytest.mark.parametrize("bias", [False, True])
def test_each_token_is_independent_of_its_batch_mates(bias):
    _, q = _layer(bias=bias)
    x = torch.randn(WIDE_ROWS + 9, 96) * torch.rand(WIDE_ROWS + 9, 1) * 4  # rows of very different ranges
    with torch.inference_mode():
        alone = torch.cat([q(x[i : i + 1]) for i in range(len(x))])
        for n in (2, 7, WIDE_ROWS + 9):  # the last one takes the wide (prefill) kernel where it exists
            assert torch.equal(q(x[:n]), alone[:n]), n


def test_wide_kernel_gives_the_same_bits_as_the_narrow_one():
    _, q = _layer()
    if q._wide is None:
        pytest.skip("oneDNN int8 kernels are not in this torch build")
    x = torch.randn(WIDE_ROWS * 2, 96)
    with torch.inference_mode():
        wide = q(x)
        saved, q._wide = q._wide, None
        narrow = q(x)
        q._wide = saved
    assert torch.equal(wide, narrow)


def test_close_to_the_float_layer():
    lin, q = _layer(n_in=256, n_out=128, bias=True)
    x = torch.randn(5, 3, 256)
    with torch.inference_mode():
        ref, got = lin(x), q(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).norm() / ref.norm()
    assert err < 0.02, err  # 8-bit weights and 7-bit activations: about 1% here


def test_zero_input_gives_bias_not_nan():
    _, q = _layer(bias=True)
    with torch.inference_mode():
        assert torch.allclose(q(torch.zeros(1, 96)), q.bias[None])
