"""The once-per-process check that picks the int8 GEMM for wide inputs: it must accept a
path with fbgemm's bits and reject one that is off by a last bit anywhere."""
import pytest
import torch

from forerun.models import int8_kernel, int8_probe
from forerun.models.quant import Int8Linear, WIDE_ROWS


def _kernel_gemm(x, w8, scale):
    lin = torch.nn.Linear(w8.shape[1], w8.shape[0], bias=False)
    q = Int8Linear(lin)
    q.weight_int8.copy_(w8)
    q.weight_scale.copy_(scale)
    q.weight_colsum.copy_(w8.sum(dim=1, dtype=torch.int32))
    q._build_kernels()
    return q._rows(x, *q._rows_args) if q._rows is not None else q._fbgemm(x)


def test_the_probe_accepts_fbgemms_bits_and_rejects_a_last_bit_off():
    if int8_kernel.load() is None:
        pytest.skip("needs the compiled kernel as the candidate")
    assert int8_probe.onednn_matches_fbgemm(96, 80, 128, gemm=_kernel_gemm)

    def one_ulp_off(x, w8, scale):
        y = _kernel_gemm(x, w8, scale)
        y[37, 5] = torch.nextafter(y[37, 5], torch.tensor(float("inf")))
        return y

    assert not int8_probe.onednn_matches_fbgemm(96, 80, 128, gemm=one_ulp_off)


def test_the_chosen_wide_path_is_exact_here():
    """Whatever the probe chose, a wide layer gives the few-token path's bits row by row."""
    choice = int8_probe.wide_path()
    assert choice in int8_probe.CHOICES
    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(64, 48, bias=True))
    assert (q._wide is not None) == (choice == "onednn")
    x = torch.randn(2 * WIDE_ROWS, 64) * torch.rand(2 * WIDE_ROWS, 1) * 3
    with torch.inference_mode():
        wide = q(x)
        assert all(torch.equal(wide[i : i + 1], q(x[i : i + 1])) for i in range(len(x)))


def test_a_forced_choice_that_is_not_available_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FORERUN_INT8_WIDE", "cuda")
    int8_probe.wide_path.cache_clear()
    try:
        with pytest.raises(ValueError, match="FORERUN_INT8_WIDE"):
            int8_probe.wide_path()
    finally:
        monkeypatch.delenv("FORERUN_INT8_WIDE")
        int8_probe.wide_path.cache_clear()
