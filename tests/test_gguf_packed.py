"""The packed GGUF kernel (gguf_packed_rows.cpp): rows of every native type (Q4_K, Q5_K, Q6_K
and the legacy 32-value Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) rearranged 16 at a time.

Packing keeps the file's bits (dequantizing the packed form is ggml's reference, bit for bit,
also for row counts that leave a tile part empty, and for rows picked out of it), the kernel
computes the same documented function as the row kernel, and a token gets the same bits alone
or in any batch. The kernel entry points are called directly, so these run at every ISA level
(test_isa_levels.py): the AVX512-VNNI path where the build has it, the plain C++ one elsewhere."""
import numpy as np
import pytest
import torch

from forerun.kernels import loader as kernel_loader

pytestmark = pytest.mark.skipif(kernel_loader.load() is None or not hasattr(kernel_loader.load(), "gguf_pack"),
                                reason="the packed GGUF kernel needs the compiled kernels")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from forerun.linears.gguf import NATIVE_TYPES, GGUFLinear, packed_simd, packs  # noqa: E402
from tests.test_gguf_native import blocks, reference  # noqa: E402

PACKED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("t", PACKED, ids=[t.name for t in PACKED])
@pytest.mark.parametrize("rows", [16, 37, 5])
def test_packing_keeps_the_files_values_bit_for_bit(t, rows):
    b = blocks(t, rows, 512, seed=rows + int(t))
    ref = quants.dequantize(b.data.numpy(), t).reshape(rows, 512)
    p = b.pack()
    assert p.packed_rows == rows and p.rows == rows and p.data.shape[0] == (rows + 15) // 16
    assert np.array_equal(p.dequantize().numpy(), ref)
    ids = torch.tensor([rows - 1, 0, rows // 2, rows // 2])
    assert np.array_equal(p.dequantize(ids).numpy(), ref[ids.numpy()])
    sub = p.select(ids)  # a reduced head: the chosen rows, packed again
    assert sub.rows == 4 and np.array_equal(sub.dequantize().numpy(), ref[ids.numpy()])


def packed_rows(x: torch.Tensor, parts, bias=None, reference=False) -> torch.Tensor:
    packed = [p.pack() for p in parts]
    return kernel_loader.load().gguf_packed_rows(x, [p.data for p in packed], [p.type for p in packed],
                                               [p.rows for p in packed], torch.empty(0) if bias is None else bias,
                                               reference=reference)


@pytest.mark.parametrize("t", PACKED, ids=[t.name for t in PACKED])
def test_the_simd_path_gives_the_plain_definitions_bits(t):
    """The packed kernel's SIMD path (AVX2 here, AVX512-VNNI where the build has it) against
    its plain C++ definition (reference=True), with torch.equal: every type, 1 to 16 tokens a
    tile and more, rows that leave a tile part empty, activations at the int8 grid's edges
    (a block of zeros, one dominated by one value, values of both signs at full scale), and
    weights at their extremes (Q8_0's -128, Q6_K's -32 and +31, 6-bit scales of 63). So the
    bits are the same on every ISA level the kernels build for."""
    k = 768 if NATIVE_TYPES[int(t)][0] == 256 else 864
    parts = [blocks(t, 37, k, seed=int(t) + 20), blocks(t, 5, k, seed=int(t) + 21)]
    if t == T.Q8_0:  # d, then 32 int8: every other value -128
        raw = parts[0].data.view(-1, 34)
        raw[::3, 2::2] = 128
    # row 0's quants all at their largest (15, 31, 63): with activations of one sign at full
    # scale (rows 3 and 4) the AVX2 path's int16 partial sums reach their bound
    quant_bytes = {T.Q4_K: (144, 16, 144), T.Q5_K: (176, 16, 176), T.Q6_K: (210, 0, 192),
                   T.Q4_0: (18, 2, 18), T.Q4_1: (20, 4, 20), T.Q5_0: (22, 2, 22), T.Q5_1: (24, 4, 24)}
    if t in quant_bytes:
        size, start, end = quant_bytes[t]
        parts[0].data.view(-1, size)[: k // NATIVE_TYPES[int(t)][0], start:end] = 0xFF
    x = torch.randn(19, k) * 3
    x[0, :256] = 0.0
    x[1, 7] = 1e4
    x[2] = torch.where(torch.arange(k) % 2 == 0, 50.0, -50.0)
    x[3], x[4] = 5.0, -5.0
    bias = torch.randn(42)
    simd = packed_rows(x, parts, bias)
    plain = packed_rows(x, parts, bias, reference=True)
    assert torch.equal(simd, plain)
    # tiles of 1 to 8 tokens, and of 9 to 16 (AVX2's paired Q4_K / Q6_K tiles take up to 16 a pass)
    for a, b in [(0, 1), (3, 5), (5, 8), (0, 4), (3, 8), (0, 6), (8, 15), (12, 19), (0, 9), (2, 14), (3, 19)]:
        assert torch.equal(packed_rows(x[a:b], parts, bias), plain[a:b])
    kernel = kernel_loader.load()
    was = kernel.set_gguf_paired_tokens(8)  # AVX2: the paired tiles 8 tokens a pass, as before
    try:
        assert torch.equal(packed_rows(x, parts, bias), plain)
        for a, b in [(0, 9), (3, 19)]:
            assert torch.equal(packed_rows(x[a:b], parts, bias), plain[a:b])
    finally:
        kernel.set_gguf_paired_tokens(was)
    # AVX2: Q4_K and Q6_K also through the loop that takes one 8-row half at a time (Q5_K's)
    was = kernel.set_gguf_paired_halves(False)
    try:
        assert torch.equal(packed_rows(x, parts, bias), plain)
        for a, b in [(0, 1), (5, 8), (12, 19)]:
            assert torch.equal(packed_rows(x[a:b], parts, bias), plain[a:b])
    finally:
        kernel.set_gguf_paired_halves(was)


@pytest.mark.parametrize("t", PACKED, ids=[t.name for t in PACKED])
def test_the_packed_kernel_computes_the_documented_function(t):
    """K of 864 for the legacy types: inputs that are not whole blocks of 256 (the 0.5B's 896,
    SmolLM2's 576), the case their packing is for."""
    torch.manual_seed(int(t))
    k = 768 if NATIVE_TYPES[int(t)][0] == 256 else 864
    w = blocks(t, 45, k, seed=int(t) + 1)
    bias = torch.randn(45)
    x = torch.randn(9, k) * 2
    x[:, 5] = 40.0  # one large channel: its block's scale, not the others'
    ref = reference(x, w) + bias.double()
    y = packed_rows(x, [w], bias)
    assert y.shape == (9, 45)
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


def test_packed_rows_get_the_same_bits_alone_and_in_any_batch():
    """Token tiles of 1 to 16 (and more tokens than a tile): a token's bits never depend on
    its batch-mates; a fused linear of every packed type (activations per 256 and per 32 side
    by side) gives each part its own output rows."""
    torch.manual_seed(0)
    parts = [blocks(T.Q4_K, 40, 512, 1), blocks(T.Q6_K, 24, 512, 2), blocks(T.Q5_K, 3, 512, 3),
             blocks(T.Q5_0, 17, 512, 4), blocks(T.Q8_0, 16, 512, 5), blocks(T.Q4_1, 5, 512, 6),
             blocks(T.Q5_1, 9, 512, 7), blocks(T.Q4_0, 2, 512, 8)]
    x = torch.randn(21, 512)
    together = packed_rows(x, parts)
    for i in range(21):
        assert torch.equal(packed_rows(x[i : i + 1], parts), together[i : i + 1])
    for a, b in [(0, 2), (2, 5), (5, 21), (1, 17), (3, 7)]:
        assert torch.equal(packed_rows(x[a:b], parts), together[a:b])
    assert torch.equal(packed_rows(x.view(3, 7, 512), parts).view(21, -1), together)
    start = 0
    for p in parts:
        assert torch.equal(packed_rows(x, [p]), together[:, start : start + p.rows])
        start += p.rows


def test_legacy_tiles_over_inputs_not_whole_256s_are_batch_invariant():
    parts = [blocks(T.Q5_0, 21, 864, 9), blocks(T.Q8_0, 16, 864, 10), blocks(T.Q4_1, 7, 864, 11)]
    x = torch.randn(11, 864)
    together = packed_rows(x, parts)
    for i in range(11):
        assert torch.equal(packed_rows(x[i : i + 1], parts), together[i : i + 1])
    assert torch.equal(packed_rows(x[2:9], parts), together[2:9])


def test_a_linear_packs_where_the_kernel_has_vnni_and_keeps_its_function(monkeypatch):
    parts = [blocks(T.Q4_K, 20, 256, 4), blocks(T.Q6_K, 12, 256, 5)]
    lin = GGUFLinear(parts)
    assert lin.packed == packs(parts) == packed_simd()
    x = torch.randn(3, 256)
    ref = torch.cat([reference(x, p) for p in parts], 1)
    assert (lin(x).double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    ids = torch.tensor([31, 0, 19, 20])
    full = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.float_rows(ids), full[ids])
    head = GGUFLinear([parts[0]])
    sub = head.select_rows(torch.tensor([3, 7]))
    assert torch.equal(sub(x), head(x)[:, [3, 7]])
    monkeypatch.setenv("FORERUN_GGUF_ROWS", "1")
    rows = GGUFLinear(parts)
    assert not rows.packed  # forced onto the row kernel: the same function
    assert (rows(x).double() - ref).abs().max() <= 2e-6 * ref.abs().max()


def test_bad_packed_input_is_refused():
    kernel = kernel_loader.load()
    w = blocks(T.Q4_K, 8, 512).pack()
    with pytest.raises(RuntimeError, match="no packed kernel"):
        kernel.gguf_pack(blocks(T.Q5_K, 8, 512).data, 10, 512)  # Q2_K
    with pytest.raises(RuntimeError, match="packed part"):
        kernel.gguf_packed_rows(torch.randn(2, 512), [w.data], [w.type], [40], torch.empty(0))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.gguf_packed_select(w.data, w.type, torch.tensor([16]), 512)
