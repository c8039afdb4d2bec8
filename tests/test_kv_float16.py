"""A float16 KV cache (kv_cache_dtype="float16"): half the bytes, and still batch-invariant.

Every key and value is rounded to the nearest float16 as it is written, by the kernels
(rope_write_attend, the one-call layer and the layer stack) and by torch (KVCache.write,
PagedKVCache.write) alike; the kernels widen the rows they read back to float32 exactly and
attend with the float32 cache's code. So a prompt's K/V and logits are the same bits whole,
chunked or decoded, speculative output equals plain output and a prefix-cache hit changes no
token, as on the float32 cache. Checked with torch.equal, with every torch attention path
made to fail (the kernels really ran), and at each kernel precision (int8, int4, float32,
gguf; Gemma 3's masked kernel too). The cache really is lossy: the logits move.
"""
import dataclasses

import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.kernels import loader as kernel_loader
from forerun.kernels.backend import CpuKernels
from forerun.kv.cache import KVCache, chain_batch, tree_batch
from forerun.kv.prefix import PrefixPool
from forerun.llm import LLM
from tests.test_prefill_invariance import PROMPT, assert_same, run
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TURN1 = [(5 * i * i + i + 3) % 61 + 1 for i in range(100)]


def _model(dtype: str, kv_cache: str = "float16"):
    model = tiny_model(seed=4, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    model.set_kv_cache(kv_cache)
    return model


def _llm(dtype="int8", kv_cache_dtype="float16", **kw):
    model = tiny_model(seed=6, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    return LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, **kw)


class CountingKernel:
    """The kernel module, counting the calls of its attention entry points from Python."""

    ATTENTION = ("attend_prefix", "attend_masked", "rope_write_attend", "decoder_layer_rows")

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, {name: 0 for name in self.ATTENTION}

    def __getattr__(self, name):
        f = getattr(self.kernel, name)
        if name not in self.ATTENTION:
            return f

        def counted(*args):
            self.calls[name] += 1
            return f(*args)

        return counted


@pytest.fixture
def no_torch_attention(monkeypatch):
    """Every torch attention path (SDPA, the one-query matmuls, Gemma's) reads the cache through
    `read`: failing it makes a silent fallback from the kernels fail the test."""
    from forerun.kv.paged import PagedKVCache

    def fail(*_):
        raise AssertionError("torch attention ran on the float16 cache")

    monkeypatch.setattr(KVCache, "read", fail)
    monkeypatch.setattr(PagedKVCache, "read", fail)


# --- (a) what is stored -------------------------------------------------------------------


def test_a_float16_cache_stores_float16_in_half_the_bytes():
    from forerun.kv.paged import PagedKVCache

    half, full = _model("int8"), _model("int8", "auto")
    assert (half.kv_dtype, full.kv_dtype) == (torch.float16, torch.float32)
    a, b = half.new_cache(2, 64), full.new_cache(2, 64)
    assert a.dtype == torch.float16 and all(t.dtype == torch.float16 for t in a.k + a.v)
    assert sum(t.nbytes for t in a.k + a.v) * 2 == sum(t.nbytes for t in b.k + b.v)
    paged = PagedKVCache(half, rows=2, capacity=64, num_blocks=8, block_size=16)
    assert paged.dtype == torch.float16 and all(t.dtype == torch.float16 for t in paged.k_pool + paged.v_pool)
    assert _llm().model.kv_dtype == torch.float16 and _llm(kv_cache_dtype="auto").model.kv_dtype == torch.float32


def test_only_float32_activations_take_a_float16_cache():
    with pytest.raises(ConfigError, match="float32 activations"):
        tiny_model(dtype="float64").set_kv_cache("float16")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        _model("int8", "int8")


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("path", ["kernels", "torch writes"])
def test_keys_and_values_are_the_float32_ones_rounded_to_nearest(dtype, path):
    """Layer 0's K/V see only the embedding: on a float16 cache they must be the float32 cache's
    rounded as torch rounds (.half()), whether the kernels wrote them (rope_write_attend, one-call
    layer, stack) or torch did (KVCache.write: fused_layer off)."""
    half, full = _model(dtype), _model(dtype, "auto")
    if path == "torch writes":
        half.set_backend(dataclasses.replace(half.backend, fused_layer=False))
    for chunks in ([150], [70] + [1] * 80):  # a prompt's forward, then decoding steps
        k16, v16, _ = run(half, PROMPT, chunks)
        k32, v32, _ = run(full, PROMPT, chunks)
        assert k16[0].dtype == torch.float16
        assert torch.equal(k16[0], k32[0].half()) and torch.equal(v16[0], v32[0].half())


def test_the_float16_cache_is_lossy_the_logits_move():
    """The power of the tests here: a float16 cache is really read (its logits differ from the
    float32 cache's), yet gives the same bits along every path."""
    assert not torch.equal(run(_model("int8"), PROMPT, [150])[2], run(_model("int8", "auto"), PROMPT, [150])[2])


# --- (b) batch invariance, (c) on the kernels -----------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
def test_whole_chunked_and_decoded_prefill_give_the_same_bits(dtype, no_torch_attention):
    model = _model(dtype)
    whole = run(model, PROMPT, [150])
    assert whole[0][0].dtype == torch.float16
    assert_same(whole, run(model, PROMPT, [64, 64, 22]))
    assert_same(whole, run(model, PROMPT, [100, 1, 49]))
    assert_same(whole, run(model, PROMPT, [70] + [1] * 80))


def test_prompt_rows_through_sdpa_give_other_logits():
    """The check's power on a float16 cache: rounding K/V to float16 can hide a prompt path's
    float32 differences in the stored K/V, not in the logits (which assert_same compares too)."""
    model = _model("int8")
    whole = run(model, PROMPT, [150])
    model.set_backend(dataclasses.replace(model.backend, prefill_sdpa=True))
    assert not torch.equal(whole[2], run(model, PROMPT, [150])[2])


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_every_attention_runs_in_the_kernels(dtype, no_torch_attention):
    """A prompt, decoding steps (layer by layer: the stack calls its layers in C++) and a token
    tree: each attention goes through a kernel entry point, none through torch."""
    model = _model(dtype)
    backend = model.backend
    assert isinstance(backend, CpuKernels) and backend.takes(torch.zeros(1), model.new_cache(1, 4))
    counting = CountingKernel(backend.kernel)
    model.set_backend(dataclasses.replace(backend, kernel=counting, stacked=False))
    run(model, PROMPT[:75], [70] + [1] * 5)
    cache = model.new_cache(1, 40)
    with torch.inference_mode():
        model(chain_batch([PROMPT[:15]], [0], [0], model.device), cache)
        model(tree_batch([[7, 2, 20, 11]], [[-1, 0, 0, 1]], [15], [0], model.device), cache)
    calls = counting.calls
    assert calls["attend_masked"] >= 2  # the tree, per layer
    one_call = calls["decoder_layer_rows"] if dtype == "int8" else calls["rope_write_attend"]
    assert one_call >= 2 * 5  # the decoding steps, per layer


@pytest.mark.parametrize("dtype", ["float32", "int8", "gguf"])
def test_gemmas_masked_layers_keep_the_bits_on_a_float16_cache(dtype, no_torch_attention):
    from tests.test_gemma3_invariance import _model as gemma

    model = gemma(dtype)
    model.set_kv_cache("float16")
    ids = [(5 * i + 3) % 60 + 1 for i in range(100)]
    whole = run(model, ids, [100])
    assert whole[0][0].dtype == torch.float16
    assert_same(whole, run(model, ids, [64, 36]))
    assert_same(whole, run(model, ids, [70] + [1] * 30))


@pytest.mark.parametrize("head_dim", [64, 8])
def test_the_kernels_read_a_float16_cache_as_its_values_in_float32(head_dim):
    """attend_prefix and attend_masked over a float16 cache give the bits they give over the same
    values held in float32: the widening is exact and the attention code is the float32 one."""
    kernel = kernel_loader.load()
    g = torch.Generator().manual_seed(5)
    k16, v16 = (torch.randn(2, 2, 48, head_dim, generator=g).half() for _ in range(2))
    q = torch.randn(2, 6, 3, head_dim, generator=g)
    rows, limits, scale = torch.tensor([1, 0]), torch.tensor([[30, 31, 32], [5, 6, 7]]), head_dim**-0.5
    assert torch.equal(kernel.attend_prefix(q, k16, v16, rows, limits, scale),
                       kernel.attend_prefix(q, k16.float(), v16.float(), rows, limits, scale))
    mask = torch.rand(2, 3, 40, generator=g) < 0.5
    mask[:, :, 0] = True
    assert torch.equal(kernel.attend_masked(q, k16, v16, rows, mask, scale),
                       kernel.attend_masked(q, k16.float(), v16.float(), rows, mask, scale))


def test_a_gguf_file_loads_with_a_float16_cache_and_keeps_the_bits(tmp_path, monkeypatch, no_torch_attention):
    """The whole load path (resolve_precision -> load_model -> finish_model) from a GGUF file, and
    a draft model named by path follows the verifier's KV dtype."""
    from tests.test_gguf_native import write_quantized_gguf

    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q.gguf"
    write_quantized_gguf(path)
    llm = LLM(str(path), dtype="gguf", progress=False, kv_cache_dtype="float16")
    assert llm.precision.kv_dtype == torch.float16 and llm.model.kv_dtype == torch.float16
    ids = [(7 * i * i + 3 * i + 1) % 200 + 3 for i in range(90)]
    whole = run(llm.model, ids, [90])
    assert_same(whole, run(llm.model, ids, [64, 26]))
    assert_same(whole, run(llm.model, ids, [70] + [1] * 20))
    drafter = llm.drafter_for(SpeculativeConfig("draft_model", 3, draft_model=str(path), draft_dtype="int8"))
    assert drafter.model.kv_dtype == torch.float16


def test_the_paged_cache_gives_the_row_caches_bits(no_torch_attention):
    """The server's paged cache: blocks scattered in a float16 pool, read by the kernels through its tables."""
    from tests.test_serve_paged import scattered_cache

    model = _model("int8")
    paged, rows = scattered_cache(model, 2, 120, bs=16), model.new_cache(2, 120)
    out = []
    with torch.inference_mode():
        for cache in (paged, rows):
            model(chain_batch([PROMPT[:80], PROMPT[:30]], [0, 0], [0, 1], model.device), cache)
            step = model(chain_batch([[3, 4], [5]], [80, 30], [0, 1], model.device), cache).logits
            tree = model(tree_batch([[9, 1, 2]], [[-1, 0, 0]], [31], [1], model.device), cache).logits
            out.append((step, tree))
    assert paged.dtype == torch.float16
    for a, b in zip(*out):
        assert torch.equal(a, b)


# --- (d) speculative = plain, (e) the prefix cache ----------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "tree"])
def test_greedy_speculative_equals_plain_on_a_float16_cache(dtype, branches):
    llm = _llm(dtype, enable_prefix_caching=False)
    prompts = [TURN1[:40], [1, 2, 3, 4, 5, 1, 2, 3], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1]]
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY, speculative=None)]
    spec = SpeculativeConfig("ngram", 4, ngram_max=3, ngram_min=1, ngram_branches=branches)
    outs = llm.generate(prompts, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4, ngram_max=3, ngram_min=1)], ids=["plain", "ngram"])
def test_a_prefix_cache_hit_gives_the_cold_output_on_a_float16_cache(spec):
    warm, cold = _llm(), _llm(enable_prefix_caching=False)
    first = warm.generate([TURN1], GREEDY, speculative=spec)[0]
    turn2 = TURN1 + first.token_ids + [7, 8, 9, 10, 11]
    hot, ref = warm.generate([turn2], GREEDY, speculative=spec)[0], cold.generate([turn2], GREEDY, speculative=spec)[0]
    assert hot.num_cached_tokens >= 128 and hot.token_ids == ref.token_ids
    assert all(b.k.dtype == torch.float16 for b in warm.prefix_cache.blocks.values())


def test_float16_blocks_are_never_found_by_a_float32_cache():
    """The pool's keys carry the KV dtype (LLM.prefix_salt): the same model and tokens under a
    float32 cache name other blocks, and a float16 block takes half the bytes."""
    half, full = _llm(), _llm(kv_cache_dtype="auto")
    assert b"kv=torch.float16" in half.prefix_salt() and b"kv=torch.float32" in full.prefix_salt()
    assert half.prefix_cache.keys(TURN1) != full.prefix_cache.keys(TURN1)
    half.generate([TURN1], GREEDY)
    full.generate([TURN1], GREEDY)
    assert half.prefix_cache.used_bytes * 2 == full.prefix_cache.used_bytes > 0
    mixed = PrefixPool(block_size=16, max_bytes=2**30, salt=full.prefix_salt())
    mixed.blocks.update(half.prefix_cache.blocks)  # float16 blocks, in a pool keyed for float32
    assert mixed.lookup(TURN1 + [1]).tokens == 0


def test_doctests():
    import doctest

    from forerun import precision

    assert doctest.testmod(precision).failed == 0 and doctest.testmod(precision).attempted >= 5


# --- the flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve", "quality"])
def test_the_commands_take_kv_cache_dtype(command):
    from forerun.cli import build_parser

    args = build_parser().parse_args([command, "--kv-cache-dtype", "float16"])
    assert args.kv_cache_dtype == "float16" and build_parser().parse_args([command]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--kv-cache-dtype", "int8"])


def test_load_llm_passes_the_flag_to_llm(monkeypatch):
    from forerun import cli_args, llm

    seen = {}
    monkeypatch.setattr(llm, "LLM", lambda **kw: seen.update(kw))
    cli_args.load_llm(_args("float16"), None)
    assert seen["kv_cache_dtype"] == "float16"


def _args(kv: str):
    from forerun.cli import build_parser

    return build_parser().parse_args(["generate", "--kv-cache-dtype", kv])


def test_quality_measures_float32_itself_on_a_float16_cache():
    from forerun.bench.commands import _quality_dtypes
    from forerun.bench.fidelity import label_of

    assert _quality_dtypes("float32,gguf", kv_cache="float16") == ["float32", "gguf"]
    assert _quality_dtypes("float32,gguf") == ["gguf"]  # float32 on its own cache is the reference
    assert [label_of(d, "float16") for d in ("float32", "gguf")] == ["float32 kv=float16", "gguf kv=float16"]
