"""int8 linears: per-token results independent of batch-mates, every kernel (forerun's
compiled few-token kernel, oneDNN for prefill, fbgemm as the fallback) giving the same
bits, and close to the float32 layer they replace."""
import pytest
import torch

from forerun.models import int8_kernel
from forerun.models.quant import WIDE_ROWS, Int8Linear, activation_qparams


def _layer(n_in=96, n_out=80, bias=False, seed=0, use_kernel=True):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    return lin, Int8Linear(lin, use_kernel=use_kernel)


def _fbgemm_reference(q: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """torch's own dynamic int8 linear on the same int8 weights, one token at a time
    (one row + the anchor: the quantisation range is exactly [-1, 1])."""
    zeros = torch.zeros(q.out_features, dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(q.weight_int8, q.weight_scale.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    rows = []
    for row in x:
        s = row.abs().max().clamp_min(1e-12)
        y = torch.ops.quantized.linear_dynamic(torch.stack([row / s, q.anchor[0]]), packed, True)[0] * s
        rows.append(y if q.bias is None else y + q.bias)
    return torch.stack(rows)


def _rows(n, width=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * torch.rand(n, 1, generator=g) * 4  # very different ranges


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_gives_fbgemms_bits_for_every_batch_size(use_kernel, bias):
    """n=1 and 7 take the few-token path (compiled kernel, or fbgemm); 2*WIDE_ROWS the
    prefill path (oneDNN where present). All must equal per-token fbgemm exactly."""
    _, q = _layer(bias=bias, use_kernel=use_kernel)
    x = _rows(2 * WIDE_ROWS)
    with torch.inference_mode():
        ref = _fbgemm_reference(q, x)
        for n in (1, 7, 2 * WIDE_ROWS):
            assert torch.equal(q(x[:n]), ref[:n]), n


def test_the_kernel_is_built_here():
    """On this project's machines (g++, x86) the compiled kernel must exist: without it
    int8 decoding silently runs ~2x slower."""
    if int8_kernel.load() is None:
        pytest.skip("no C++ toolchain: the PyTorch fallback is tested above")
    _, q = _layer()
    assert q._rows is not None and q._packed is None


def test_kernel_handles_any_width():
    """Widths that are not a multiple of the 64-byte vector take the masked tail."""
    for width in (2, 63, 65, 130):
        _, q = _layer(n_in=width, n_out=9)
        x = _rows(3, width)
        with torch.inference_mode():
            assert torch.equal(q(x), _fbgemm_reference(q, x)), width


def test_activation_qparams_are_fbgemms_for_minus_one_to_one():
    scale, zero = activation_qparams()
    assert abs(scale - 2 / 127) < 1e-7 and zero == 64


def test_close_to_the_float_layer():
    lin, q = _layer(n_in=256, n_out=128, bias=True)
    x = torch.randn(5, 3, 256)
    with torch.inference_mode():
        ref, got = lin(x), q(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).norm() / ref.norm()
    assert err < 0.02, err  # 8-bit weights and 7-bit activations: about 1% here


@pytest.mark.parametrize("use_kernel", [True, False])
def test_zero_input_gives_bias_not_nan(use_kernel):
    _, q = _layer(bias=True, use_kernel=use_kernel)
    with torch.inference_mode():
        assert torch.allclose(q(torch.zeros(1, 96)), q.bias[None])


def test_a_folded_rms_norm_computes_linear_of_norm():
    """absorb_norm: the kernel runs the RMSNorm itself. Same function as norm then linear
    (not the same bits: the norm's float rounding differs), still per token."""
    from forerun.models.llama import RMSNorm

    lin, q = _layer(bias=True)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = _rows(2 * WIDE_ROWS)
    with torch.inference_mode():
        unfolded = q(norm(x))
        if not q.absorb_norm(norm):
            pytest.skip("no compiled kernel: norms stay separate")
        folded = q(x)  # the first 63 rows through the kernel's norm, the rest... all 128 rows: wide path
        few = torch.cat([q(x[i : i + 1]) for i in range(8)])
        assert torch.equal(q(x[:8]), few)  # per token
        assert torch.allclose(folded, unfolded, rtol=0.02, atol=0.02 * unfolded.abs().max())
        assert torch.allclose(few, unfolded[:8], rtol=0.02, atol=0.02 * unfolded.abs().max())
        ref = lin(norm(x))
        assert ((few - ref[:8]).norm() / ref[:8].norm()) < 0.02


def test_copy_and_pickle_rebuild_the_kernels():
    """The kernels' weight copies are opaque handles: deepcopy / torch.save must rebuild
    them from the int8 weights, with the same outputs."""
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


@pytest.mark.parametrize("use_kernel", [True, False])
def test_other_dtypes_and_grad_modes(use_kernel):
    """bfloat16 input is computed in float32 and returned as bfloat16; the fbgemm fallback's
    reused buffer works in and out of inference mode."""
    _, q = _layer(use_kernel=use_kernel)
    x = _rows(3)
    with torch.inference_mode():
        ref = q(x)
    with torch.no_grad():
        assert torch.equal(q(x), ref)
        y = q(x.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max())


def test_quantisation_ties_round_like_fbgemm():
    """fbgemm rounds fma(x, 1/scale, zero) (the zero point added before rounding); rounding
    x/scale first differs about 2 times in a million. Rows holding exactly those values
    (and 1.0, so the row scale is exact) must still match fbgemm bit for bit."""
    scale, zero = activation_qparams()
    v = torch.rand(2_000_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    inv = torch.tensor(1.0) / torch.tensor(scale, dtype=torch.float32)
    fused = torch.round((v.double() * inv.double() + zero).float())
    unfused = torch.round(v * inv) + zero
    ties = v[fused != unfused]
    assert len(ties) > 0
    _, q = _layer(n_in=len(ties) + 1, n_out=32)
    x = torch.cat([torch.ones(1), ties])[None]
    with torch.inference_mode():
        assert torch.equal(q(x), _fbgemm_reference(q, x))
