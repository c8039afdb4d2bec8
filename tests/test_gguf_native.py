"""dtype "gguf": linears over a GGUF file's own quantized blocks.

The kernel reads ggml's block layouts (dequantization equal to gguf's reference, bit for bit,
for every type), computes the documented function (per-block int8 activations x the blocks),
gives a token the same bits alone or beside others, and so `gguf` speculative decoding emits
exactly what `gguf` plain decoding emits, on a tiny random model written as a GGUF with a mix
of every native type (a q/k/v of three types, llama.cpp's permuted q/k rows)."""
import dataclasses
import numpy as np
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.kernels import loader as kernel_loader

pytestmark = pytest.mark.skipif(kernel_loader.load() is None or not hasattr(kernel_loader.load(), "gguf_rows"),
                                reason="gguf needs the compiled kernels")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from forerun.linears.gguf import NATIVE_TYPES, Blocks, GGUFEmbedding, GGUFLinear, packed_simd  # noqa: E402

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
ALL = LEGACY + K_TYPES


def random_blocks(t: T, rows: int, k: int, rng, scale: float = 0.02) -> np.ndarray:
    """[rows, bytes] valid blocks of type t: every byte random except the float16 scales,
    set to small values so the weights stay near `scale` (the legacy types quantized from
    Gaussian weights by gguf's own quantizer)."""
    if t in LEGACY:
        return quants.quantize((rng.standard_normal((rows, k)) * scale).astype(np.float32), t)
    qk, nbytes = NATIVE_TYPES[int(t)]
    b = rng.integers(0, 256, (rows, k // qk * nbytes), dtype=np.uint8).reshape(rows, k // qk, nbytes)
    f16 = lambda v: np.frombuffer(v.astype(np.float16).tobytes(), np.uint8).reshape(rows, k // qk, -1)  # noqa: E731
    if t == T.Q6_K:  # w = d * sc * (q - 32), sc int8, q < 64
        b[:, :, 208:210] = f16(rng.uniform(0.2, 1.0, (rows, k // qk)) * scale / 64 / 16)
    else:  # w = d * sc * q - dmin * m, sc and m < 64, q < 32
        b[:, :, 0:4] = f16(rng.uniform(0.2, 1.0, (rows, k // qk, 2)) * scale / 64 / 8)
    return b.reshape(rows, -1)


def blocks(t: T, rows: int, k: int, seed: int = 0) -> Blocks:
    return Blocks(torch.from_numpy(random_blocks(t, rows, k, np.random.default_rng(seed))), int(t), k)


@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_dequantization_is_ggml_reference_bit_for_bit(t):
    b = blocks(t, 37, 512, seed=int(t))
    ref = quants.dequantize(b.data.numpy(), t).reshape(37, 512)
    kernel = kernel_loader.load()
    for vector in (True, False):  # the AVX2 decoder and the scalar one
        ids = torch.arange(37)
        assert np.array_equal(kernel.gguf_dequant_rows(b.data, int(t), ids, 512, vector).numpy(), ref), vector
    ids = torch.tensor([36, 0, 5, 5])
    assert np.array_equal(b.dequantize(ids).numpy(), ref[ids.numpy()])


def reference(x: torch.Tensor, w: Blocks) -> torch.Tensor:
    """float64 of the documented function: x quantized per block of the weight's width (int8,
    scale max|x| / 127, round half to even), times the dequantized weights."""
    qk = NATIVE_TYPES[w.type][0]
    xb = x.double().view(x.shape[0], -1, qk)
    amax = xb.abs().amax(-1, keepdim=True).float()
    inv = torch.full_like(amax, 127.0) / amax  # a true division: `127 / amax` is reciprocal() * 127, one rounding off
    q = torch.clamp(torch.round(xb.float() * inv), -127, 127).nan_to_num(0.0).double()  # 0 * inf: a zero block
    a = (q * (amax / 127).double()).view(x.shape)
    return a @ w.dequantize().double().T


@pytest.fixture(params=["packed", "rows"])
def kernel_choice(request, monkeypatch):
    """Both kernels of a GGUFLinear: the packed one where the build has AVX512-VNNI (which a
    linear takes by default there), and the row kernel (FORERUN_GGUF_ROWS=1, every CPU's)."""
    if request.param == "rows":
        monkeypatch.setenv("FORERUN_GGUF_ROWS", "1")
    return request.param


@pytest.mark.parametrize("t", ALL, ids=[t.name for t in ALL])
def test_the_kernel_computes_the_documented_function(t, kernel_choice):
    torch.manual_seed(int(t))
    w = blocks(t, 45, 768, seed=int(t) + 1)
    bias = torch.randn(45)
    lin = GGUFLinear([w], bias)
    x = torch.randn(9, 768) * 2
    ref = reference(x, w) + bias.double()
    y = lin(x)
    assert lin.packed == (kernel_choice == "packed" and packed_simd())
    assert y.shape == (9, 45)
    assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_0], ids=["Q4_K", "Q5_0"])
def test_activation_blocks_at_the_edges_quantize_as_documented(t, kernel_choice):
    """An all-zero block, one dominated by a single value, and values at the int8 grid's
    half-steps (round half to even): the vector quantizer gives the documented function."""
    w = blocks(t, 19, 512, seed=7)
    x = torch.randn(5, 512)
    x[0, :256] = 0.0  # a zero block (K types: 256 wide; legacy: 8 blocks of 32)
    x[1, 3] = 1e4  # one value sets the whole block's scale
    x[2] = (torch.arange(512) % 255 - 127).float() / 2  # k / 2: many exact .5 steps of amax / 127
    x[2, 0] = 127.0
    ref = reference(x, w)
    y = GGUFLinear([w])(x)
    # each row against its own size (row 1's is ~1e3 times the others'): float32 sums stay under
    # 3e-6 of it, while one activation rounded the other way moves an output by ~ amax / 127 * |w|,
    # 2e-4 of row 2's (the half-steps; the reference's `127 / amax` as a reciprocal did exactly that)
    err, size = (y.double() - ref).abs().amax(1), ref.abs().amax(1)
    assert (err <= 1e-5 * size).all()


def test_rows_get_the_same_bits_alone_and_in_any_batch_across_mixed_parts(monkeypatch):
    """A fused linear of three types (K and legacy: two activation quantizations) gives each
    token the bits it gets alone, in any batch shape, and each part its own output rows (the
    row kernel throughout: a Q4_K part alone would otherwise take the packed one)."""
    monkeypatch.setenv("FORERUN_GGUF_ROWS", "1")
    torch.manual_seed(0)
    parts = [blocks(T.Q4_K, 40, 512, 1), blocks(T.Q6_K, 24, 512, 2), blocks(T.Q5_0, 33, 512, 3)]
    lin = GGUFLinear(parts)
    x = torch.randn(21, 512)
    together = lin(x)
    for i in range(21):
        assert torch.equal(lin(x[i : i + 1]), together[i : i + 1])
    for a, b in [(0, 3), (2, 9), (5, 21), (1, 17)]:
        assert torch.equal(lin(x[a:b]), together[a:b])
    assert torch.equal(lin(x.view(3, 7, 512)).view(21, -1), together)
    start = 0
    for p in parts:
        assert torch.equal(GGUFLinear([p])(x), together[:, start : start + p.rows])
        start += p.rows


def test_select_rows_and_float_rows_read_the_same_blocks():
    parts = [blocks(T.Q8_0, 30, 256, 4), blocks(T.Q4_1, 20, 256, 5)]
    lin = GGUFLinear(parts)
    ids = torch.tensor([49, 0, 31, 29, 30])
    full = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.float_rows(ids), full[ids])
    head = GGUFLinear([parts[0]])
    sub = head.select_rows(torch.tensor([3, 7]))
    x = torch.randn(4, 256)
    assert torch.equal(sub(x), head(x)[:, [3, 7]])


def test_the_embedding_looks_up_exact_rows_and_refuses_bad_ids():
    b = blocks(T.Q5_0, 50, 64 * 4, 6)
    emb = GGUFEmbedding(b)
    ids = torch.tensor([[1, 49], [0, 1]])
    assert torch.equal(emb(ids), b.dequantize()[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))


def test_a_part_with_a_bad_shape_is_refused():
    kernel = kernel_loader.load()
    w = blocks(T.Q4_K, 8, 512)
    with pytest.raises(RuntimeError, match="blocks of 256"):
        kernel.gguf_rows(torch.randn(2, 300), [w.data], [w.type], torch.empty(0))
    with pytest.raises(RuntimeError, match="no native kernel"):
        kernel.gguf_rows(torch.randn(2, 512), [w.data], [10], torch.empty(0))  # Q2_K


# --- a whole model -------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0, "ffn_gate": T.Q4_0,
         "ffn_up": T.Q5_1, "ffn_down": T.Q4_1}
# The last layer's MLP input in the two packed K types, as a real Q4_K_M file's; the other
# layers' gate/up (Q4_0 + Q5_1), attn_output (Q8_0) and ffn_down (Q4_1) legacy types; the q/k/v
# three K types. Every linear runs on the packed kernel (gguf_packed_rows.cpp) where the build
# has AVX512-VNNI, else on the row kernel (gguf_rows.cpp): test_isa_levels runs this file at both.
LAST_LAYER = {**TYPES, "ffn_gate": T.Q4_K, "ffn_up": T.Q6_K}


def write_quantized_gguf(path, seed: int = 0, arch: str = "llama") -> None:
    """A tiny llama (or qwen2: q/k/v biases) GGUF as llama.cpp would write a quantized one:
    every matrix in a native type (q/k/v three different ones, the last layer's gate/up Q4_K and
    Q6_K), norms and biases F32, the embedding Q5_0 and the head Q6_K."""
    import gguf

    from tests.test_gguf_convert import gpt2_byte_chars, token_type

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *gpt2_byte_chars(), "Ġt", "he", "Ġthe"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([token_type(t) for t in tokens])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd = HIDDEN // HEADS

    def matrix(name, t, rows, k, scale=0.05):
        w.add_tensor(name, random_blocks(t, rows, k, rng, scale), raw_dtype=t)

    matrix("token_embd.weight", T.Q5_0, len(tokens), HIDDEN, 1.0)
    matrix("output.weight", T.Q6_K, len(tokens), HIDDEN, 0.2)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {"attn_q": (HEADS * hd, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN), "attn_v": (KV_HEADS * hd, HIDDEN),
              "attn_output": (HIDDEN, HEADS * hd), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for kind, (rows, k) in shapes.items():
            matrix(f"blk.{i}.{kind}.weight", (LAST_LAYER if i == LAYERS - 1 else TYPES)[kind], rows, k)
        if arch == "qwen2":
            for kind in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{kind}.bias", (0.1 * rng.standard_normal(shapes[kind][0])).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("gguf-native")
    monkeypatch_module.setenv("FORERUN_CACHE_DIR", str(root / "cache"))
    path = root / "tiny-q.gguf"
    write_quantized_gguf(path)
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def verifier(tiny_gguf):
    return LLM(str(tiny_gguf), dtype="gguf", progress=False)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def plain(verifier):
    return [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]


def test_the_model_keeps_the_files_blocks(verifier):
    model = verifier.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and [p.type for p in qkv.parts] == [T.Q4_K, T.Q5_K, T.Q6_K]
    gate_up = model.model.layers[-1].mlp.gate_up_proj
    simd = packed_simd()
    assert [p.type for p in gate_up.parts] == [T.Q4_K, T.Q6_K] and qkv.packed == simd
    assert gate_up.packed == model.lm_head.packed == simd
    legacy = model.model.layers[0].mlp
    assert [p.type for p in legacy.gate_up_proj.parts] == [T.Q4_0, T.Q5_1] and legacy.gate_up_proj.packed == simd
    assert legacy.down_proj.parts[0].type == T.Q4_1 and legacy.down_proj.packed == simd
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert not any(verifier.source.glob("*.safetensors"))  # no float32 copy was written for it


def test_a_gguf_layer_in_one_call_gives_the_op_by_op_bits(verifier):
    """The RMSNorms run inside the linears they feed (absorb_norm), so a llama layer at gguf
    runs in one C++ call (layer_rows.cpp): the same logits as its Python ops, and the path
    chain forwards take."""
    import copy

    from tests.test_int8_identity import _assert_same_chain_logits, count_one_call_layers

    fused = copy.deepcopy(verifier.model)
    for layer in fused.model.layers:
        assert isinstance(layer.input_layernorm, torch.nn.Identity) and layer.self_attn.qkv_proj.pre_norm is not None
        assert layer.one_call_form() and layer.mlp.gate_up_proj.kernel_linear is not None
    calls = count_one_call_layers(fused)
    plain = copy.deepcopy(fused)
    plain.set_backend(dataclasses.replace(plain.backend, one_call=False))
    _assert_same_chain_logits(fused, plain)
    assert len(calls) == 4 * len(fused.model.layers)


def test_gguf_layers_in_one_call_give_the_layer_by_layer_bits(tiny_gguf):
    from tests.test_int8_identity import assert_stack_gives_layer_bits

    assert_stack_gives_layer_bits(LLM(str(tiny_gguf), dtype="gguf", progress=False).model)


def test_gguf_logits_follow_the_float32_model_of_the_same_file(tiny_gguf, verifier):
    """float32 computes the file's dequantized weights exactly; gguf differs only by its
    8-bit activations (and llama.cpp's q/k row order is undone the same way on both paths)."""
    f32 = LLM(str(tiny_gguf), dtype="float32", progress=False)
    ids = PROMPTS[2]
    a, b = verifier.model.score(ids), f32.model.score(ids)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_a_qwen2_file_keeps_its_biases(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    write_quantized_gguf(path, seed=3, arch="qwen2")
    native, f32 = LLM(str(path), dtype="gguf", progress=False), LLM(str(path), dtype="float32", progress=False)
    assert native.model.model.layers[1].self_attn.qkv_proj.bias is not None
    a, b = native.model.score(PROMPTS[0]), f32.model.score(PROMPTS[0])
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_vocab", "tree"])
def test_gguf_speculative_equals_gguf_plain(tiny_gguf, verifier, plain, method):
    if method == "ngram":
        spec = SpeculativeConfig("ngram", 4, ngram_max=3)
    elif method in ("draft_model", "draft_vocab"):  # a different random GGUF drafter: many partial accepts
        other = tiny_gguf.with_name("drafter-q.gguf")
        if not other.exists():
            write_quantized_gguf(other, seed=7)
        drafter = LLM(str(other), dtype="gguf", progress=False)
        options = {"draft_vocab": 40} if method == "draft_vocab" else {}  # the head cut to its kept rows' blocks
        spec = SpeculativeConfig("draft_model", 4, draft_model=drafter, options=options)
    else:  # n-gram token trees: masked attention over branches
        spec = SpeculativeConfig("ngram", 4, ngram_max=3, ngram_branches=3)
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


def test_a_quantized_self_draft_of_a_gguf_verifier_is_refused(verifier):
    with pytest.raises(Exception, match="GGUF"):
        verifier.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig("quantized", 4, quant_bits=4))


def test_gguf_batched_equals_one_by_one_with_long_prompts(verifier):
    prompts = [[(7 * i + j) % 30 + 1 for j in range(3 + 9 * i)] for i in range(9)]  # up to 75 tokens
    params = SamplingParams(temperature=0, max_tokens=10)
    alone = [verifier.generate([p], params, speculative=None)[0].token_ids for p in prompts]
    together = [o.token_ids for o in verifier.generate(prompts, params, speculative=SpeculativeConfig("ngram", 3))]
    assert together == alone


def test_a_hf_folder_refuses_gguf(tmp_path):
    from forerun.errors import ModelLoadError
    from forerun.models.loader import load_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(tmp_path, "gguf")


def test_gguf_speculative_logprobs_equal_plain(tiny_gguf, verifier):
    """The logprobs are the verifier's, bit for bit: drafted or not, chain or tree."""
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3)
    plain = verifier.generate(PROMPTS, params, speculative=None)
    for spec in (SpeculativeConfig("ngram", 4, ngram_max=3), SpeculativeConfig("ngram", 4, ngram_max=3, ngram_branches=3)):
        outs = verifier.generate(PROMPTS, params, speculative=spec)
        assert merge([o.stats for o in outs]).drafted > 0
        for a, b in zip(outs, plain):
            assert a.token_ids == b.token_ids
            assert [{t: (x.logprob, x.rank) for t, x in e.items()} for e in a.logprobs] == \
                   [{t: (x.logprob, x.rank) for t, x in e.items()} for e in b.logprobs]
