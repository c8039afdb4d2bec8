"""int4 (4-bit weights in groups of 64, int8 activations per group of 64; Q4_K blocks through
the gguf kernels where a linear's inputs are whole blocks of 256): the kernel computes the
documented function, a token's bits never depend on its batch-mates, and so int4 speculative
decoding emits exactly what int4 plain decoding emits."""
import pytest
import torch

from forerun.kernels.backend import CpuKernels
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.kernels import loader as kernel_loader
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="int4 needs the compiled kernels")

from forerun.linears.gguf import GGUFLinear  # noqa: E402
from forerun.linears.int4 import GROUP, Int4Linear, dequantize_groups, int4_linear, quantize_groups  # noqa: E402
from tests.test_quant import group_quantized  # noqa: E402


def reference(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 of the documented function: int8 activations with one scale per group of 64
    inputs (amax / 127) x the dequantised weights."""
    if lin.pre_norm is not None:
        x = lin.pre_norm(x)
    y = group_quantized(x) @ lin.weight.double().T
    return y if lin.bias is None else y + lin.bias.double()


@pytest.mark.parametrize("out_f,in_f,bias", [(48, 64, True), (37, 100, False), (300, 200, True), (33, 896, False)])
def test_the_kernel_computes_the_documented_function(out_f, in_f, bias):
    torch.manual_seed(out_f)
    lin = Int4Linear(torch.nn.Linear(in_f, out_f, bias=bias))
    x = torch.randn(11, in_f) * 3
    y = lin(x)
    ref = reference(lin, x)
    assert y.shape == (11, out_f)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_rows_get_the_same_bits_alone_and_in_any_batch():
    torch.manual_seed(0)
    lin = Int4Linear(torch.nn.Linear(200, 70))
    x = torch.randn(21, 200)
    together = lin(x)
    for i in range(21):
        assert torch.equal(lin(x[i : i + 1]), together[i : i + 1])
    for a, b in [(0, 3), (2, 9), (5, 21), (1, 17)]:  # every tile size of the kernel, and ragged tails
        assert torch.equal(lin(x[a:b]), together[a:b])
    assert torch.equal(lin(x.view(3, 7, 200)).view(21, 70), together)


@pytest.mark.parametrize("in_f", [64, 200, 896])
def test_the_simd_path_gives_the_plain_definitions_bits(in_f):
    """int4_rows' SIMD path (AVX2 here, AVX512-VNNI where the build has it) against its plain C++
    definition (reference=True), with torch.equal: 1 to 8 tokens a tile and more (AVX2's 3-8 token
    tiles both halves per pass and, switched off, a half at a time), a ragged last
    group, weights at the grid's ends (u of 0 and 15), activations at the int8 grid's edges (a
    group of zeros, one value dominating its group, full-scale values of both signs: the
    products maddubs must not saturate on), a folded norm and a bias. So the bits are the same
    on every ISA level the kernels build for (test_isa_levels.py runs this file on each)."""
    torch.manual_seed(in_f)
    src = torch.nn.Linear(in_f, 70)
    with torch.no_grad():  # every other row on its grid's two ends only: u of 0 and 15
        src.weight[::2] = torch.where(torch.arange(in_f) % 3 == 0, 4.0, -4.0)
    lin = Int4Linear(src)
    assert lin.u4_rows()[0, :in_f].unique().tolist() == [0, 15]
    x = torch.randn(19, in_f) * 3
    x[0, :64] = 0.0
    x[1, 7] = 1e4
    x[2] = torch.where(torch.arange(in_f) % 2 == 0, 50.0, -50.0)
    kernel = kernel_loader.load()
    w4, d, m = lin._packed
    bias, norm = torch.randn(70), torch.rand(in_f) + 0.5

    def rows(xs, reference=False):
        return kernel.int4_rows(xs, w4, d, m, bias, norm, 1e-6, 70, reference=reference)

    plain = rows(x, reference=True)
    assert torch.equal(rows(x), plain)
    for a, b in [(0, 1), (3, 5), (5, 8), (8, 12), (0, 5), (13, 19), (12, 19)]:  # tiles of 1 to 7 tokens
        assert torch.equal(rows(x[a:b]), plain[a:b])
    if hasattr(kernel, "set_int4_paired"):  # AVX2: 3-8 tokens a half at a time gives them too
        was = kernel.set_int4_paired(False)
        try:
            assert all(torch.equal(rows(x[a:b]), plain[a:b]) for a, b in [(0, 3), (0, 6), (0, 19)])
        finally:
            kernel.set_int4_paired(was)
    assert kernel.int4_isa() in ("avx512-vnni", "avx2", "scalar")


def test_weights_already_on_a_4_bit_grid_come_back_exactly():
    """A Q4_1 / Q4_K-style tensor (w = d u + m per 64 inputs, d and m float16) is recovered."""
    torch.manual_seed(1)
    M, K = 8, 3 * GROUP
    u = torch.randint(0, 16, (M, K))
    u[:, 0], u[:, GROUP], u[:, 2 * GROUP] = 0, 0, 0  # each group spans the whole grid...
    u[:, 1], u[:, GROUP + 1], u[:, 2 * GROUP + 1] = 15, 15, 15
    d = (torch.rand(M, 3) * 0.01 + 0.001).half()
    m = (-torch.rand(M, 3) * 0.1).half()
    w = dequantize_groups(u.to(torch.uint8), d, m, K)
    u2, d2, m2 = quantize_groups(w)
    assert torch.equal(dequantize_groups(u2, d2, m2, K), w)


def test_the_4_bit_weights_are_held_packed_only_and_unpack_exactly():
    """An int4 linear keeps half a byte a weight (no unpacked copy beside the kernel's layout);
    its rows unpack to quantize_groups' u, alone or any subset, and survive deepcopy / pickle."""
    import copy
    import io

    torch.manual_seed(2)
    base = torch.nn.Linear(130, 70)  # 70 rows: a ragged last block; 130 inputs: padded groups
    lin = Int4Linear(base)
    u_ref, _, _ = quantize_groups(base.weight.detach())
    assert torch.equal(lin.u4_rows(), u_ref)
    ids = torch.tensor([69, 0, 17, 16, 33, 5])
    assert torch.equal(lin.u4_rows(ids), u_ref[ids])
    held = sum(t.numel() * t.element_size() for t in list(lin.buffers()) + list(lin._packed))
    assert not any(t.dtype == torch.uint8 for t in lin.buffers())
    assert lin._packed[0].numel() == 96 * 192 // 2  # rows padded to 96, inputs to 192: half a byte each
    assert held < 0.7 * 96 * 192  # with the scales and minima (before: + 1 byte a weight for an unpacked copy)
    x = torch.randn(5, 130)
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    for other in (copy.deepcopy(lin), torch.load(buf, weights_only=False)):
        assert torch.equal(other(x), lin(x)) and torch.equal(other.weight, lin.weight)


def min_max_grid(w: torch.Tensor) -> torch.Tensor:
    """Per group of 64: the min-max grid's dequantized weights (m = min, d = (max - m) / 15,
    float16), the fit's first candidate."""
    g = w.float().view(w.shape[0], -1, GROUP)
    m = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - m) / 15).half().float()
    u = torch.where(d > 0, ((g - m) / d.clamp_min(1e-30)).round().clamp(0, 15), torch.zeros_like(g))
    return (d * u + m).view_as(w)


def test_the_fitted_grid_is_never_worse_than_min_max_and_mostly_better():
    """Each group's squared error is at most the min-max grid's (a small slack: that grid's u is
    computed by division here, with 1 / d there), and over a tenth less in all on Gaussian weights with
    outliers; u is the nearest level of the group's own grid."""
    torch.manual_seed(5)
    w = torch.randn(64, 8 * GROUP)
    w[::7, ::13] *= 6  # heavy tails, as trained weights have
    u, d, m = quantize_groups(w)
    fit = dequantize_groups(u, d, m, w.shape[1])
    err = lambda q: ((q - w).view(64, -1, GROUP) ** 2).sum(-1)  # noqa: E731
    assert (err(fit) <= err(min_max_grid(w)) * (1 + 1e-5) + 1e-9).all()
    assert err(fit).sum() < 0.9 * err(min_max_grid(w)).sum()  # 0.86 here; 0.83 without the outliers
    step = d.float().repeat_interleave(GROUP, 1)
    level = ((w - m.float().repeat_interleave(GROUP, 1)) / step).clamp(0, 15)
    assert ((level - u.float()).abs() <= 0.5 + 1e-3).all()


def test_the_fit_does_not_depend_on_threads():
    torch.manual_seed(6)
    w = torch.randn(300, 4 * GROUP)
    threads = torch.get_num_threads()
    fits = lambda: [*quantize_groups(w), kernel_loader.load().int4_fit_q4k(w)]  # noqa: E731
    try:
        torch.set_num_threads(2)
        many = fits()
        torch.set_num_threads(1)
        one = fits()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(many, one))


def q4k_values(blocks: torch.Tensor, K: int) -> torch.Tensor:
    """Q4_K bytes [M, K / 256 * 144] -> [M, K] float32, by ggml's dequantization (the gguf kernels')."""
    return kernel_loader.load().gguf_dequant_rows(blocks, 12, torch.arange(blocks.shape[0]), K, False)


def plain_q4k(w: torch.Tensor) -> torch.Tensor:
    """A plain Q4_K quantization's values: per sub-block of 32 the min-max line (its minimum
    held at or below 0), 6-bit multiples of per-256 float16 scales (largest / 63), nearest levels."""
    sub = w.view(w.shape[0], -1, 8, 32)
    lo = sub.amin(-1).clamp(max=0)
    s, mn = (sub.amax(-1) - lo) / 15, -lo
    D, Dm = (s.amax(-1, keepdim=True) / 63).half().float(), (mn.amax(-1, keepdim=True) / 63).half().float()
    ds = (D * (s / D).round().clamp(0, 63)).unsqueeze(-1)
    ms = (Dm * (mn / Dm).round().clamp(0, 63)).unsqueeze(-1)
    q = ((sub + ms) / ds.clamp_min(1e-30)).round().clamp(0, 15)
    return (ds * q - ms).view_as(w)


def test_q4k_blocks_are_fitted_closer_than_a_plain_q4k_and_than_groups_of_64():
    """int4's Q4_K form at the same 4.5 bits a weight: closer to Gaussian weights with outliers
    than the plain Q4_K quantization and than int4's own groups of 64."""
    torch.manual_seed(7)
    w = torch.randn(96, 1024)
    w[::7, ::13] *= 6
    fit = q4k_values(kernel_loader.load().int4_fit_q4k(w), 1024)
    err = lambda v: float(((v - w) ** 2).sum())  # noqa: E731
    assert err(fit) < 0.9 * err(plain_q4k(w))
    assert err(fit) < 0.9 * err(dequantize_groups(*quantize_groups(w), 1024))


def test_weights_already_on_a_q4k_grid_come_back_byte_for_byte():
    """Blocks as ggml's quantizer writes them (each super-block's largest scale and minimum at
    63; here every sub-block spans levels 0..15) are found again exactly, bytes included."""
    torch.manual_seed(8)
    rows, nb = 40, 4
    sc, mn = torch.randint(1, 64, (rows, nb, 8)), torch.randint(0, 64, (rows, nb, 8))
    sc[..., 2], mn[..., 5] = 63, 63
    q = torch.randint(0, 16, (rows, nb, 8, 32))
    q[..., 3], q[..., 17] = 0, 15
    D = (torch.rand(rows, nb, 1) * 1e-2 + 1e-4).half().float()
    Dm = (torch.rand(rows, nb, 1) * 1e-2).half().float()
    w = ((D * sc).unsqueeze(-1) * q - (Dm * mn).unsqueeze(-1)).view(rows, nb * 256)
    blocks = kernel_loader.load().int4_fit_q4k(w)
    assert torch.equal(q4k_values(blocks, nb * 256), w)
    assert torch.equal(kernel_loader.load().int4_fit_q4k(q4k_values(blocks, nb * 256)), blocks)


def test_int4_takes_the_q4k_form_for_whole_blocks_of_256_only():
    torch.manual_seed(9)
    wide, narrow = torch.nn.Linear(512, 40), torch.nn.Linear(896, 40, bias=False)
    q, g = int4_linear(wide), int4_linear(narrow)
    assert isinstance(q, GGUFLinear) and [p.type for p in q.parts] == [12] and isinstance(g, Int4Linear)
    x = torch.randn(3, 512)
    assert torch.equal(q.weight, q4k_values(kernel_loader.load().int4_fit_q4k(wide.weight.detach()), 512))
    assert torch.equal(q.bias, wide.bias.detach())
    blocks = x.double().view(3, 2, 256)  # the gguf kernels' activations: int8, one scale per 256
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    xq = ((blocks / scale).round().clamp(-127, 127) * scale).view(3, 512)
    ref = torch.nn.functional.linear(xq, q.weight.double(), q.bias.double())
    assert (q(x).double() - ref).abs().max() < 1e-5 * ref.abs().max()
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel_loader.load().int4_fit_q4k(narrow.weight.detach())


def test_padding_does_not_widen_the_last_group():
    w = torch.linspace(0.5, 1.0, 70).repeat(2, 1)  # 70 inputs: the last group has 6 real ones
    u, d, m = quantize_groups(w)
    assert u.shape == (2, 128) and torch.all(u[:, 70:] == 0)
    assert (dequantize_groups(u, d, m, 70) - w).abs().max() < 0.5 * d.float().max()


def test_an_absorbed_norm_is_applied_first():
    from forerun.models.llama import RMSNorm

    torch.manual_seed(2)
    lin = Int4Linear(torch.nn.Linear(64, 32))
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 64) * 4
    assert lin.absorb_norm(norm)
    assert (lin(x).double() - reference(lin, x)).abs().max() <= 1e-5 * reference(lin, x).abs().max()


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module", params=[(0, 64, 128), (1, 64, 128), (2, 256, 512), (3, 64, 256)],
                ids=["groups", "groups2", "q4k", "mixed"])
def verifier(request):  # widths of 256: the Q4_K form, on the gguf kernels; "mixed": only down_proj (256 inputs)
    seed, hidden, ffn = request.param
    return LLM(tiny_model(seed=seed, dtype="int4", hidden_size=hidden, intermediate_size=ffn), dtype="int4")


@pytest.fixture(scope="module")
def plain(verifier):
    return [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]


def test_the_int4_model_uses_the_kernels(verifier):
    layer = verifier.model.model.layers[0]
    cfg = verifier.model.config
    form = GGUFLinear if cfg.hidden_size % 256 == 0 else Int4Linear
    assert isinstance(layer.self_attn.qkv_proj, form) and isinstance(verifier.model.lm_head, form)
    assert isinstance(layer.mlp.down_proj, GGUFLinear if cfg.intermediate_size % 256 == 0 else Int4Linear)
    assert isinstance(verifier.model.backend, CpuKernels) and verifier.model.backend.fused
    assert layer.self_attn.qkv_proj.pre_norm is not None
    assert layer.one_call_form() and layer.bound_linears() is not None  # the layer in one C++ call, whichever forms its linears take


@pytest.mark.parametrize("method", ["ngram", "draft_model", "quantized"])
def test_int4_speculative_equals_int4_plain(verifier, plain, method):
    if method == "ngram":
        spec = SpeculativeConfig("ngram", 4, ngram_max=3)
    elif method == "draft_model":  # an unrelated random int4 drafter: many partial accepts
        drafter = LLM(tiny_model(seed=3, dtype="int4", hidden_size=64, intermediate_size=128), dtype="int4")
        spec = SpeculativeConfig("draft_model", 4, draft_model=drafter)
    else:
        with pytest.raises(Exception, match="int4"):  # the verifier's own int4 copy would be itself
            verifier.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig("quantized", 4, quant_bits=4))
        return
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


def test_int4_batched_equals_one_by_one_with_long_prompts(verifier):
    prompts = [[(7 * i + j) % 30 + 1 for j in range(3 + 9 * i)] for i in range(9)]  # up to 75 tokens
    params = SamplingParams(temperature=0, max_tokens=10)
    alone = [verifier.generate([p], params, speculative=None)[0].token_ids for p in prompts]
    together = [o.token_ids for o in verifier.generate(prompts, params, speculative=SpeculativeConfig("ngram", 3))]
    assert together == alone


def test_a_float32_verifier_with_an_int4_self_draft_is_exact():
    verifier = LLM(tiny_model(seed=4, dtype="float32", hidden_size=64, intermediate_size=128), dtype="float32")
    plain = [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]
    outs = verifier.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig("quantized", 4, quant_bits=4))
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).accepted > 0
