"""Automatic prefix caching (kv/prefix.py) through LLM: a later prompt that starts with an
earlier prompt + answer reads those blocks instead of computing them, and its output is the
same, bit for bit, as with no cache: greedy and seeded sampling, plain and speculative.
Every test asserts that the cache was hit (cached_tokens > 0), and compares K/V and logits
with torch.equal, not only tokens."""
import torch
import pytest

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.kernels import loader as kernel_loader
from forerun.kv.cache import KVCache, chain_batch
from forerun.kv.prefix import PrefixPool, block_keys, restore
from forerun.llm import LLM
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels (batch-invariant)")
TURN1 = [(5 * i * i + i + 3) % 61 + 1 for i in range(100)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(dtype="int8", **kw):
    model = tiny_model(seed=6, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    return LLM(model, dtype=dtype, **kw)


def test_on_by_default_only_where_hits_are_exact():
    assert _llm("int8").prefix_cache is not None and _llm("float32").prefix_cache is not None
    assert LLM(tiny_model(dtype="float64")).prefix_cache is None  # torch's kernels: opt-in
    assert LLM(tiny_model(dtype="float64"), enable_prefix_caching=True).prefix_cache is not None
    assert _llm("int8", enable_prefix_caching=False).prefix_cache is None


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4, ngram_max=3, ngram_min=1)], ids=["plain", "ngram"])
def test_a_later_turn_reads_the_earlier_turn_and_gives_the_same_output(dtype, spec):
    warm, cold = _llm(dtype), _llm(dtype, enable_prefix_caching=False)
    first = warm.generate([TURN1], GREEDY, speculative=spec)[0]
    assert first.num_cached_tokens == 0
    turn2 = TURN1 + first.token_ids + [7, 8, 9, 10, 11]  # the answer resent, then the new message
    hot = warm.generate([turn2], GREEDY, speculative=spec)[0]
    ref = cold.generate([turn2], GREEDY, speculative=spec)[0]
    assert hot.num_cached_tokens >= 128 and hot.num_cached_tokens % 16 == 0  # the prompt and most of the answer
    assert hot.token_ids == ref.token_ids
    assert warm.prefix_cache.stats.hit == hot.num_cached_tokens


def test_seeded_sampling_is_the_same_bits_warm_and_cold():
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    warm, cold = _llm(), _llm(enable_prefix_caching=False)
    warm.generate([TURN1], params)
    prompt = TURN1 + [3, 4]
    hot, ref = warm.generate([prompt], params)[0], cold.generate([prompt], params)[0]
    assert hot.num_cached_tokens == 96 and hot.token_ids == ref.token_ids


def test_restored_kv_and_logits_equal_computed_ones():
    llm = _llm()
    model = llm.model
    llm.generate([TURN1], GREEDY)
    blocks = llm.prefix_cache.lookup(TURN1 + [1])
    assert len(blocks) == 6  # 96 of the 100 prompt tokens + 1: whole blocks only
    warm, cold = model.new_cache(1, 128), model.new_cache(1, 128)
    n = restore(blocks, warm, 0)
    with torch.inference_mode():
        a = model(chain_batch([TURN1[n:]], [n], [0], model.device), warm).logits[0, -1]
        b = model(chain_batch([TURN1], [0], [0], model.device), cold).logits[0, -1]
    assert torch.equal(a, b)
    for kw, kc, vw, vc in zip(warm.k, cold.k, warm.v, cold.v):
        assert torch.equal(kw[0, :, :100], kc[0, :, :100]) and torch.equal(vw[0, :, :100], vc[0, :, :100])


def test_concurrent_prompts_sharing_a_prefix_get_their_alone_answers():
    llm = _llm()
    llm.generate([TURN1], GREEDY)
    prompts = [TURN1 + [i, i + 1] for i in range(1, 5)]
    together = llm.generate(prompts, GREEDY)
    alone = [_llm(enable_prefix_caching=False).generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone and all(o.num_cached_tokens == 96 for o in together)


def test_eviction_is_lru_and_leaf_first_within_the_bound():
    cache = KVCache(1, 1, 1, 64, 1, torch.float32, "cpu")  # one layer, one row, 64 slots
    per_block = 2 * 16 * 4  # K and V of one 16-token block, float32
    pool = PrefixPool(block_size=16, max_bytes=3 * per_block, salt=b"t")
    a, b = list(range(64)), [99] + list(range(1, 64))
    assert pool.store(a, cache, 0, 48) == 3  # a's three blocks: full
    pool.lookup(a[:17])  # a's first block used again
    assert pool.store(b, cache, 0, 32) == 2  # room: a's leaves go first (its third, then its second)
    keys_a = block_keys(a, 16, pool.salt + b"/")
    assert keys_a[0] in pool.blocks and keys_a[1] not in pool.blocks and keys_a[2] not in pool.blocks
    assert pool.stats.evicted == 32 and pool.used_bytes <= pool.max_bytes
    assert all(b.parent is None or b.parent in pool.blocks for b in pool.blocks.values())  # every kept block reachable


def test_the_salt_separates_tenants():
    pool = _llm().prefix_cache
    pool.store(TURN1, KVCache(1, 1, 1, 64, 1, torch.float32, "cpu"), 0, 48, salt=b"alice")
    assert len(pool.lookup(TURN1, salt=b"alice")) == 3 and pool.lookup(TURN1, salt=b"bob") == []


def test_doctests():
    import doctest

    from forerun.kv import prefix

    assert doctest.testmod(prefix).failed == 0


def test_a_draft_models_own_cache_is_kept_and_read_too():
    """The draft model's K/V of the earlier turn are copied in, not fed again; the output is the
    same as with no cache anywhere, and the drafter still drafts."""
    spec = SpeculativeConfig("draft_model", 3, draft_model=_llm("int4"))
    cold_spec = SpeculativeConfig("draft_model", 3, draft_model=_llm("int4", enable_prefix_caching=False))
    warm, cold = _llm(), _llm(enable_prefix_caching=False)
    first = warm.generate([TURN1], GREEDY, speculative=spec)[0]
    turn2 = TURN1 + first.token_ids + [7, 8, 9]
    drafter_pool = spec.draft_model.prefix_cache
    hits_before = drafter_pool.stats.hit
    hot = warm.generate([turn2], GREEDY, speculative=spec)[0]
    ref = cold.generate([turn2], GREEDY, speculative=cold_spec)[0]
    assert hot.token_ids == ref.token_ids and hot.stats.drafted > 0
    assert drafter_pool.stats.hit - hits_before >= 128 and hot.num_cached_tokens >= 128
