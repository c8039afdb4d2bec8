"""int8 with forerun's kernels is batch-invariant, so speculative decoding at int8 emits
exactly what plain decoding at int8 emits (not merely what float32 would): the per-token
int8 linears and the per-query chain attention give a token the same bits whether it is
scored alone or beside k drafted tokens. Token trees too: their attention runs the same
per-query code over each node's visible keys (attend_masked), so a node on the accepted
path gets the bits its chain would."""
import dataclasses
import pytest

from forerun.kernels.backend import CpuKernels
from forerun.config import SamplingParams, SpeculativeConfig
from forerun.llm import LLM
from forerun.metrics import merge
from forerun.kernels import loader as kernel_loader
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled int8 kernels")


@pytest.fixture(scope="module", params=[0, 1, 2])
def verifier(request):
    """Several seeds: with SDPA instead of the per-query kernel, seed 1 already diverges."""
    # head_dim 16: the attention kernel's vector path (head_dim 64 in SmolLM2) is the one tested
    return LLM(tiny_model(seed=request.param, dtype="int8", hidden_size=64, intermediate_size=128), dtype="int8")


@pytest.fixture(scope="module")
def plain(verifier):
    return [o.token_ids for o in verifier.generate(PROMPTS, GREEDY, speculative=None)]


def test_the_int8_model_uses_the_kernels(verifier):
    layer = verifier.model.model.layers[0]
    assert isinstance(verifier.model.backend, CpuKernels) and verifier.model.backend.fused
    assert layer.self_attn.qkv_proj.pre_norm is not None and layer.mlp.gate_up_proj.pre_norm is not None


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_int8_speculative_equals_int8_plain(verifier, plain, method, k):
    if method == "ngram":
        spec = SpeculativeConfig("ngram", k, ngram_max=3)
    else:  # an unrelated random drafter: many rejections, so many partial accepts
        spec = SpeculativeConfig("draft_model", k, draft_model=LLM(tiny_model(seed=3, hidden_size=64, intermediate_size=128)))
    outs = verifier.generate(PROMPTS, GREEDY, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


@pytest.mark.parametrize("spec", [
    dict(method="ngram", num_speculative_tokens=4, ngram_max=3, ngram_min=1, ngram_branches=3),
    dict(method="draft_model", num_speculative_tokens=3, tree_width=3),
    dict(method="lookahead", num_speculative_tokens=4),
], ids=["ngram-tree", "draft_model-tree", "lookahead"])
def test_int8_tree_verification_equals_int8_plain(verifier, plain, spec):
    if spec["method"] == "draft_model":
        spec = {**spec, "draft_model": LLM(tiny_model(seed=3, hidden_size=64, intermediate_size=128))}
    outs = verifier.generate(PROMPTS, GREEDY, speculative=SpeculativeConfig(**spec))
    assert [o.token_ids for o in outs] == plain
    assert merge([o.stats for o in outs]).drafted > 0


def _tree_path_equals_chain(model) -> bool:
    """A tree forward (the path pending -> a -> b -> c with siblings between) against the
    chain forward of the same tokens: are the path's logits bit-identical?"""
    import torch

    from forerun.kv.cache import chain_batch, tree_batch

    prompt, path = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [7, 2, 11, 4]  # pending 7, then a b c
    with torch.inference_mode():
        chain_cache, tree_cache = model.new_cache(1, 40), model.new_cache(1, 40)
        for c in (chain_cache, tree_cache):
            model(chain_batch([prompt], [0], [0], model.device), c, logits_at=None)
        chain = model(chain_batch([path], [len(prompt)], [0], model.device), chain_cache).logits[0]
        nodes, parents = [7, 2, 20, 11, 21, 4], [-1, 0, 0, 1, 1, 3]  # 20, 21: siblings off the path
        tree = model(tree_batch([nodes], [parents], [len(prompt)], [0], model.device), tree_cache).logits[0]
    return torch.equal(tree[[0, 1, 3, 5]], chain)


def test_a_tree_forward_gives_the_accepted_path_its_chain_logits(verifier):
    """The bit-level check behind tree identity (attend_masked)."""
    assert _tree_path_equals_chain(verifier.model)


def test_the_tree_check_catches_sdpa_tree_attention():
    """With SDPA's masked kernel instead (masked_attention off), the path's logits differ
    from the chain's (in 2 of these 3 tiny models; a real model's in most forwards)."""
    models = []
    for seed in range(3):
        m = LLM(tiny_model(seed=seed, dtype="int8", hidden_size=64, intermediate_size=128), dtype="int8").model
        m.set_backend(dataclasses.replace(m.backend, masked=False))
        models.append(m)
    assert not all(_tree_path_equals_chain(m) for m in models)


def test_masked_attention_gives_a_tree_node_its_chain_bits():
    """attend_masked over a chain's mask equals attend_prefix; a node whose ancestors sit at
    scattered slots, with the same K/V there, gets exactly the chain's output."""
    import torch

    kernel = kernel_loader.load()
    for head_dim in (64, 8):
        g = torch.Generator().manual_seed(2)
        cap, s0, T = 64, 40, 4
        k, v = torch.randn(1, 2, cap, head_dim, generator=g), torch.randn(1, 2, cap, head_dim, generator=g)
        q = torch.randn(1, 6, T, head_dim, generator=g)
        limits = torch.arange(s0 + 1, s0 + T + 1)[None]
        chain = kernel.attend_prefix(q, k, v, torch.tensor([0]), limits, head_dim**-0.5)
        mask = (torch.arange(s0 + T)[None, :] < limits[0][:, None])[None]  # [1, T, S]
        assert torch.equal(kernel.attend_masked(q, k, v, torch.tensor([0]), mask, head_dim**-0.5), chain)
        # the last query's path s0 .. s0+3 moved to slots s0, s0+2, s0+5, s0+7 (siblings in between)
        tree_k, tree_v = k.clone(), v.clone()
        slots = [s0, s0 + 2, s0 + 5, s0 + 7]
        tree_k[:, :, slots], tree_v[:, :, slots] = k[:, :, s0 : s0 + T], v[:, :, s0 : s0 + T]
        seen = torch.zeros(1, 1, s0 + 8, dtype=torch.bool)
        seen[0, 0, :s0], seen[0, 0, slots] = True, True
        node = kernel.attend_masked(q[:, :, T - 1 :], tree_k, tree_v, torch.tensor([0]), seen, head_dim**-0.5)
        assert torch.equal(node[:, :, 0], chain[:, :, T - 1])


def test_int8_batched_equals_one_by_one(verifier, plain):
    alone = [verifier.generate([p], GREEDY, speculative=None)[0].token_ids for p in PROMPTS]
    assert alone == plain


def test_wide_batches_keep_the_bits(verifier):
    """Over WIDE_ROWS tokens per forward the linears switch kernel (oneDNN): 12 rows x
    (k + 1) = 72 tokens per verify step, and one prompt long enough for SDPA's prefill.
    Each row must still get exactly what it gets alone."""
    prompts = [[(7 * i + j) % 30 + 1 for j in range(3 + i)] for i in range(11)] + [[(j * 5) % 31 for j in range(70)]]
    params = SamplingParams(temperature=0, max_tokens=12)
    alone = [verifier.generate([p], params, speculative=None)[0].token_ids for p in prompts]
    assert [o.token_ids for o in verifier.generate(prompts, params, speculative=None)] == alone
    spec = SpeculativeConfig("draft_model", 5, draft_model=LLM(tiny_model(seed=3, hidden_size=64, intermediate_size=128)))
    assert [o.token_ids for o in verifier.generate(prompts, params, speculative=spec)] == alone


@pytest.mark.parametrize("head_dim", [64, 8])  # the vector path and the plain C++ one
def test_a_query_gets_its_bits_in_any_group(head_dim):
    """The queries of a KV head's query heads go over its keys together, 64 keys at a time:
    a query's output is the one it gets alone (one head, one query, its KV head only) and
    the same with one thread (another split of the groups), over key counts across chunks."""
    import torch
    import torch.nn.functional as F

    kernel = kernel_loader.load()
    g = torch.Generator().manual_seed(4)
    cap, s0, T, H, Hkv = 1100, 700, 3, 6, 2
    k, v = torch.randn(1, Hkv, cap, head_dim, generator=g), torch.randn(1, Hkv, cap, head_dim, generator=g)
    q = torch.randn(1, H, T, head_dim, generator=g)
    limits = torch.tensor([[s0 + 1, s0 + 2, 513]])  # odd and even counts past chunk ends, one at 8 chunks + 1
    rows = torch.tensor([0])
    out = kernel.attend_prefix(q, k, v, rows, limits, head_dim**-0.5)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(T):
            alone = kernel.attend_prefix(q[:, h : h + 1, t : t + 1].contiguous(), k[:, kv : kv + 1].contiguous(),
                                         v[:, kv : kv + 1].contiguous(), rows, limits[:, t : t + 1], head_dim**-0.5)
            assert torch.equal(alone[0, 0, 0], out[0, h, t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.attend_prefix(q, k, v, rows, limits, head_dim**-0.5), out)
    finally:
        torch.set_num_threads(threads)
    mask = torch.arange(cap)[None, :] < limits[0][:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out, ref, atol=2e-6)


@pytest.mark.parametrize("head_dim", [64, 8])  # the vector path and the plain C++ one
def test_prefix_attention_is_per_query_and_matches_sdpa(head_dim):
    """Each query's output is bit-identical whether computed alone or among T queries,
    and equal to SDPA with the chain mask up to float rounding."""
    import torch
    import torch.nn.functional as F

    kernel = kernel_loader.load()
    g = torch.Generator().manual_seed(0)
    cap, s0, T = 300, 250, 6
    k, v = torch.randn(2, 3, cap, head_dim, generator=g), torch.randn(2, 3, cap, head_dim, generator=g)
    q = torch.randn(1, 12, T, head_dim, generator=g)
    limits = torch.arange(s0 + 1, s0 + T + 1)[None]
    out = kernel.attend_prefix(q, k, v, torch.tensor([1]), limits, head_dim**-0.5)
    for t in range(T):
        alone = kernel.attend_prefix(q[:, :, t : t + 1], k, v, torch.tensor([1]), limits[:, t : t + 1], head_dim**-0.5)
        assert torch.equal(alone[:, :, 0], out[:, :, t])
    mask = torch.arange(s0 + T)[None, :] < limits[0][:, None]
    ref = F.scaled_dot_product_attention(q, k[1:, :, : s0 + T], v[1:, :, : s0 + T], attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out, ref, atol=2e-6)


@pytest.mark.parametrize("head_dim", [64, 8])  # the vector path and the plain C++ one
def test_the_fused_attention_layer_equals_the_op_by_op_path(head_dim):
    """rope_write_attend (RoPE, cache write, attention in one call) writes the same cache
    entries and returns the same bits as apply_rope + KVCache.write + attend_prefix, for
    ragged rows at different slots of a GQA cache."""
    import torch

    from forerun.models.rope import apply_rope, inv_frequencies, rope_cos_sin

    kernel = kernel_loader.load()
    g = torch.Generator().manual_seed(1)
    H, Hkv, B, T, cap = 6, 2, 3, 5, 120
    k, v = torch.randn(4, Hkv, cap, head_dim, generator=g), torch.randn(4, Hkv, cap, head_dim, generator=g)
    k_ref, v_ref = k.clone(), v.clone()
    qkv = torch.randn(B, T, (H + 2 * Hkv) * head_dim, generator=g)
    rows, slots = torch.tensor([3, 0, 1]), torch.tensor([90, 4, 40])[:, None] + torch.arange(T)[None]
    cos, sin = rope_cos_sin(slots, inv_frequencies(head_dim, 10000.0, None).float(), torch.float32)
    out = kernel.rope_write_attend(qkv, cos, sin, k, v, rows, slots, H, Hkv, head_dim**-0.5)

    x = qkv.view(B, T, H + 2 * Hkv, head_dim).transpose(1, 2)
    qk = apply_rope(x[:, : H + Hkv], cos, sin)
    for b in range(B):
        k_ref[rows[b], :, slots[b]] = qk[b, H:]
        v_ref[rows[b], :, slots[b]] = x[b, H + Hkv :]
    ref = kernel.attend_prefix(qk[:, :H], k_ref, v_ref, rows, slots + 1, head_dim**-0.5)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(out, ref.transpose(1, 2).reshape(B, T, H * head_dim))


def test_the_model_gives_the_same_bits_with_and_without_the_fused_layer(verifier):
    """The int8 model's chain forwards (one token, a draft of 5, ragged rows) through
    rope_write_attend give exactly the logits of the op-by-op path."""
    import copy

    fused = verifier.model
    assert fused.backend.fused_layer
    plain = copy.deepcopy(fused)
    plain.set_backend(dataclasses.replace(plain.backend, fused_layer=False))
    _assert_same_chain_logits(fused, plain)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_layer_in_one_call_gives_the_op_by_op_bits(dtype):
    """decoder_layer_rows (layer_rows.cpp) runs a whole int8 / int4 layer from C++: the same
    logits as the layer's Python ops, and it is the path these forwards actually take."""
    import copy

    fused = LLM(tiny_model(seed=5, dtype=dtype, hidden_size=64, intermediate_size=128), dtype=dtype).model
    fused.set_backend(dataclasses.replace(fused.backend, stacked=False))  # layer by layer (the stack's own test is below)
    assert all(layer.one_call_form() for layer in fused.model.layers)
    calls = count_one_call_layers(fused)
    plain = copy.deepcopy(fused)
    plain.set_backend(dataclasses.replace(plain.backend, one_call=False))
    _assert_same_chain_logits(fused, plain)
    assert len(calls) == 4 * len(fused.model.layers)  # every forward: the prompts and the three steps


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_layers_in_one_call_give_the_layer_by_layer_bits(dtype):
    """LayerStack (layer_rows.cpp) runs every layer's one call from one call: the same
    logits as calling the layers from Python, and the path chain forwards take."""
    assert_stack_gives_layer_bits(LLM(tiny_model(seed=5, dtype=dtype, hidden_size=64, intermediate_size=128),
                                      dtype=dtype).model)


def assert_stack_gives_layer_bits(fused):
    import copy

    stack, calls = fused.backend.stack, []
    assert stack is not None
    fused.backend.stack = lambda *a: calls.append(1) or stack(*a)
    plain = copy.deepcopy(fused)
    assert plain.backend.stack is None  # a copy runs layer by layer until its own stack is bound
    _assert_same_chain_logits(fused, plain)
    assert len(calls) == 4  # every forward: the prompts and the three steps


def count_one_call_layers(model) -> list:
    """A list that grows by one each time `model`'s backend runs a layer in one call."""
    calls, layer = [], model.backend.layer

    def counted(*args):
        out = layer(*args)
        if out is not None:
            calls.append(1)
        return out

    model.backend.layer = counted  # (this backend only: a copy's set_backend builds a fresh one)
    return calls


def _assert_same_chain_logits(a, b):
    """Prompts, then chain steps of 1, 5 and 2 tokens over two ragged rows: equal logits."""
    import torch

    from forerun.kv.cache import chain_batch

    prompts, steps = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]], [[5], [3, 5, 8, 9, 7], [1, 2]]
    with torch.inference_mode():
        caches = [m.new_cache(2, 32) for m in (a, b)]
        outs = [m(chain_batch(prompts, [0, 0], [0, 1], m.device), c).logits for m, c in zip((a, b), caches)]
        assert torch.equal(*outs)
        starts = [len(p) for p in prompts]
        for new in steps:
            batch = [new, new[:1]]  # ragged: the second row gets one token
            outs = [m(chain_batch(batch, starts, [0, 1], m.device), c).logits for m, c in zip((a, b), caches)]
            assert torch.equal(*outs)
            starts = [s + len(t) for s, t in zip(starts, batch)]


def test_a_wide_forward_gives_each_row_its_own_logits(verifier):
    """The bit-level version: 12 rows x 6 tokens (over WIDE_ROWS: oneDNN linears) against
    each row alone (6 tokens: the compiled kernel), logits equal to the last bit."""
    import torch

    from forerun.kv.cache import chain_batch

    m = verifier.model
    rows = [[(7 * i + j) % 30 + 1 for j in range(6)] for i in range(12)]
    with torch.inference_mode():
        together = m(chain_batch(rows, [0] * 12, list(range(12)), m.device), m.new_cache(12, 8)).logits
        for i, r in enumerate(rows):
            alone = m(chain_batch([r], [0], [0], m.device), m.new_cache(1, 8)).logits
            assert torch.equal(together[i], alone[0]), i


LONG_PROMPTS = [[(11 * i + 3 * j + j * j) % 31 + 1 for j in range(n)] for i, n in enumerate((70, 131, 96, 64, 200))]


@pytest.mark.parametrize("method", [None, "ngram"])
def test_long_prompts_together_equal_one_by_one(verifier, method):
    """Prompts past WIDE_ROWS tokens (prefill through the wide linears and SDPA, each row
    on its own shapes), of different lengths, batched with each other and with a short
    one: every completion equals the one it gets alone, plain and speculative."""
    prompts = LONG_PROMPTS + [PROMPTS[0]]
    spec = SpeculativeConfig("ngram", 4, ngram_max=3) if method else None
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [verifier.generate([p], params, speculative=spec)[0].token_ids for p in prompts]
    assert [o.token_ids for o in verifier.generate(prompts, params, speculative=spec)] == alone


def test_a_ragged_long_prefill_gives_each_row_its_own_logits(verifier):
    """The bit-level version for prefill: rows of 70-200 tokens and one of 8, together and
    alone, logits equal to the last bit at every real position."""
    import torch

    from forerun.kv.cache import chain_batch

    m = verifier.model
    rows = LONG_PROMPTS + [PROMPTS[0]]
    n = len(rows)
    with torch.inference_mode():
        together = m(chain_batch(rows, [0] * n, list(range(n)), m.device), m.new_cache(n, 256)).logits
        for i, r in enumerate(rows):
            alone = m(chain_batch([r], [0], [0], m.device), m.new_cache(1, 256)).logits
            assert torch.equal(together[i, : len(r)], alone[0]), i


def _rows_differing_alone(model, rows) -> int:
    import torch

    from forerun.kv.cache import chain_batch

    n = len(rows)
    with torch.inference_mode():
        together = model(chain_batch(rows, [0] * n, list(range(n)), model.device), model.new_cache(n, 256)).logits
        return sum(
            not torch.equal(together[i, : len(r)], model(chain_batch([r], [0], [0], model.device), model.new_cache(1, 256)).logits[0])
            for i, r in enumerate(rows)
        )


def test_these_checks_catch_batch_dependent_attention(verifier):
    """The checks keep their power: with the per-query attention switched off (SDPA over
    the padded batch), ragged rows no longer get their own bits, and the check sees it."""
    import copy

    model = copy.deepcopy(verifier.model)
    model.set_backend(dataclasses.replace(model.backend, per_query=False, fused_layer=False))
    ragged = [[(7 * i + j) % 30 + 1 for j in range(3 + i)] for i in range(12)] + LONG_PROMPTS
    assert _rows_differing_alone(verifier.model, ragged) == 0
    assert _rows_differing_alone(model, ragged) > 0


def test_silu_mul_rows_vector_path_gives_the_scalar_definitions_bits():
    """silu_mul_rows' vector form (AVX-512 or AVX2, whichever this build has) against its scalar
    definition (`reference=True`), bit for bit: a dense sweep over where exp under- and overflows
    (near g = 88.5 and g = -88.5, e's rounding to inf or a finite value decides the output), the
    clamps at -104 and 89, signed zeros, infinities, NaN, and row widths that leave every tail."""
    import torch

    kernel = kernel_loader.load()
    sweep = torch.cat([torch.linspace(-120.0, 120.0, 240_001), torch.linspace(-88.8, -88.3, 50_001),
                       torch.linspace(87.0, 105.0, 20_001), torch.randn(10_000) * 4,
                       torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40])])
    up = torch.randn(sweep.numel(), generator=torch.Generator().manual_seed(1)) * 3
    checked = 0
    for width in (1, 5, 8, 9, 15, 16, 17, 33, 1000):
        n = sweep.numel() // width * width
        gu = torch.cat([sweep[:n].view(-1, width), up[:n].view(-1, width)], dim=1)
        fast, ref = kernel.silu_mul_rows(gu), kernel.silu_mul_rows(gu, reference=True)
        nan = torch.isnan(ref)
        assert torch.equal(nan, torch.isnan(fast)), f"width {width}: NaN where the definition has none"
        assert torch.equal(fast[~nan].view(torch.int32), ref[~nan].view(torch.int32)), f"width {width}: bits differ"
        checked += int((~nan).sum())
    assert checked > 2_000_000


def test_silu_mul_rows_takes_empty_inputs():
    """No rows, or a zero-width [gate | up]: an empty result of the right shape, not a crash."""
    import torch

    kernel = kernel_loader.load()
    assert kernel.silu_mul_rows(torch.zeros(3, 0)).shape == (3, 0)
    assert kernel.silu_mul_rows(torch.zeros(0, 8)).shape == (0, 4)
    gu = torch.randn(2, 3, 10)
    want = torch.nn.functional.silu(gu[..., :5]) * gu[..., 5:]
    assert torch.allclose(kernel.silu_mul_rows(gu), want, rtol=1e-6, atol=1e-6)
