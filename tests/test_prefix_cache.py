"""Automatic prefix caching (kv/prefix.py) through LLM: a later prompt that starts with an
earlier prompt + answer reads those blocks instead of computing them, and its output is the
same, bit for bit, as with no cache: greedy and seeded sampling, plain and speculative.
Every warm-against-cold test asserts that the cache was hit (cached_tokens > 0) and compares the
outputs' logprobs (the logits at every generated token, as exact floats) besides the tokens;
test_restored_kv_and_logits_equal_computed_ones compares restored K/V and logits with torch.equal."""
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
SCORED = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=4)


def _llm(dtype="int8", **kw):
    model = tiny_model(seed=6, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    return LLM(model, dtype=dtype, **kw)


def test_on_by_default_only_where_hits_are_exact():
    assert _llm("int8").prefix_cache is not None and _llm("float32").prefix_cache is not None
    assert LLM(tiny_model(dtype="float64")).prefix_cache is None  # torch's kernels: opt-in
    with pytest.warns(RuntimeWarning, match="a cache hit may change tokens"):  # opt-in, said so
        assert LLM(tiny_model(dtype="float64"), enable_prefix_caching=True).prefix_cache is not None
    assert _llm("int8", enable_prefix_caching=False).prefix_cache is None


@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4, ngram_max=3, ngram_min=1)], ids=["plain", "ngram"])
def test_a_later_turn_reads_the_earlier_turn_and_gives_the_same_output(dtype, spec):
    warm, cold = _llm(dtype), _llm(dtype, enable_prefix_caching=False)
    first = warm.generate([TURN1], GREEDY, speculative=spec)[0]
    assert first.num_cached_tokens == 0
    turn2 = TURN1 + first.token_ids + [7, 8, 9, 10, 11]  # the answer resent, then the new message
    hot = warm.generate([turn2], SCORED, speculative=spec)[0]
    ref = cold.generate([turn2], SCORED, speculative=spec)[0]
    # all that turn 1 computed: the prompt and the answer but its last token (8 whole blocks + a tail of 11)
    assert hot.num_cached_tokens == len(TURN1) + len(first.token_ids) - 1 == 139
    assert hot.token_ids == ref.token_ids and hot.logprobs == ref.logprobs and len(hot.logprobs) == 40
    assert warm.prefix_cache.stats.hit == hot.num_cached_tokens


def test_seeded_sampling_is_the_same_bits_warm_and_cold():
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True, logprobs=4)
    warm, cold = _llm(), _llm(enable_prefix_caching=False)
    first = warm.generate([TURN1], params)[0]
    prompt = TURN1 + [3, 4]
    hot, ref = warm.generate([prompt], params)[0], cold.generate([prompt], params)[0]
    # 6 whole blocks, then 4 (or 5) tokens of the 7th, which turn 1 left after TURN1's end
    assert hot.num_cached_tokens == 100 + (first.token_ids[0] == 3) and hot.token_ids == ref.token_ids
    assert hot.logprobs == ref.logprobs and len(hot.logprobs) == 30


def test_restored_kv_and_logits_equal_computed_ones():
    llm = _llm()
    model = llm.model
    llm.generate([TURN1], GREEDY)
    match = llm.prefix_cache.lookup(TURN1)
    assert len(match.blocks) == 6 and match.tail_len == 3  # 96 + 3 of TURN1's 100: its last is left to compute
    warm, cold = model.new_cache(1, 128), model.new_cache(1, 128)
    n = restore(match, warm, 0)
    assert n == 99
    with torch.inference_mode():
        a = model(chain_batch([TURN1[n:]], [n], [0], model.device), warm).logits[0, -1]
        b = model(chain_batch([TURN1], [0], [0], model.device), cold).logits[0, -1]
    assert torch.equal(a, b)
    for kw, kc, vw, vc in zip(warm.k, cold.k, warm.v, cold.v):
        assert torch.equal(kw[0, :, :100], kc[0, :, :100]) and torch.equal(vw[0, :, :100], vc[0, :, :100])


@pytest.mark.parametrize("stage,pool_block", [(1 << 30, 16), (1, 16), (1 << 30, 8)],
                         ids=["one-run", "a-block-a-run", "pool-blocks-of-8"])
def test_a_restore_copies_the_same_bits_into_rows_and_a_paged_pool(monkeypatch, stage, pool_block):
    from forerun.kv import prefix
    from forerun.kv.paged import PagedKVCache

    llm = _llm()
    llm.generate([TURN1], GREEDY)
    match = llm.prefix_cache.lookup(TURN1)  # 6 whole blocks and 3 tokens of a 7th
    monkeypatch.setattr(prefix, "STAGE_BYTES", stage)
    rows = llm.model.new_cache(2, 128)
    paged = PagedKVCache(llm.model, rows=2, capacity=128, num_blocks=32, block_size=pool_block)
    paged.set_table(1, [9, 3, 14, 0, 7, 12, 5, 1, 20, 31, 2, 17, 25, 4, 11, 28][: 128 // pool_block])  # scattered
    assert restore(match, rows, 1) == restore(match, paged, 1) == 99
    for layer in range(len(rows.k)):
        want_k = torch.cat([b.k[layer] for b in match.blocks] + [match.tail.k[layer][:, :3]], dim=1)  # [H, 99, D]
        want_v = torch.cat([b.v[layer] for b in match.blocks] + [match.tail.v[layer][:, :3]], dim=1)
        assert torch.equal(rows.k[layer][1, :, :99], want_k) and torch.equal(rows.v[layer][1, :, :99], want_v)
        got_k, got_v = paged.export_slots(1, 0, 99)
        assert torch.equal(got_k[layer], want_k) and torch.equal(got_v[layer], want_v)
    assert not rows.k[0][0].any() and not rows.k[0][1, :, 99:].any()  # nothing else written


def test_concurrent_prompts_sharing_a_prefix_get_their_alone_answers():
    llm = _llm()
    first = llm.generate([TURN1], GREEDY)[0]
    prompts = [TURN1 + [i, i + 1] for i in range(1, 5)]
    together = llm.generate(prompts, GREEDY)
    alone = [_llm(enable_prefix_caching=False).generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone
    assert [o.num_cached_tokens for o in together] == [100 + (first.token_ids[0] == i) for i in range(1, 5)]


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


def test_eviction_takes_the_least_recently_used_leaf():
    cache = KVCache(1, 1, 1, 64, 1, torch.float32, "cpu")
    pool = PrefixPool(block_size=16, max_bytes=2 * 2 * 16 * 4, salt=b"t")  # room for two blocks
    older, newer, third = [1] * 17, [2] * 17, [3] * 17  # three one-block chains: every block a leaf
    assert pool.store(older, cache, 0, 16) == 1 and pool.store(newer, cache, 0, 16) == 1
    assert pool.lookup(older).tokens == 16  # `older` is now the one used last
    assert pool.store(third, cache, 0, 16) == 1  # room for it: `newer`, used least recently, goes
    assert pool.lookup(newer).tokens == 0 and pool.lookup(older).tokens == 16 and pool.lookup(third).tokens == 16
    assert pool.stats.evicted == 16


def _numbered_cache(slots: int = 64) -> KVCache:
    """One layer, one row, K of slot s = s and V = -s: which slots a restore copied shows."""
    cache = KVCache(1, 1, 1, slots, 1, torch.float32, "cpu")
    cache.k[0][0, 0, :, 0] = torch.arange(slots, dtype=torch.float32)
    cache.v[0][0, 0, :, 0] = -torch.arange(slots, dtype=torch.float32)
    return cache


def test_a_hit_reads_to_the_token_a_tail_and_a_whole_block_left_part_way():
    """After its whole blocks a prompt reads the cached tokens it shares: a stored tail (the
    answer's last partial block), or the first tokens of a whole block it diverges inside."""
    pool, src = PrefixPool(block_size=16, max_bytes=1 << 20, salt=b"t"), _numbered_cache()
    a = list(range(100, 164))
    assert pool.store(a, src, 0, 40) == 3 and pool.stats.stored == 40  # 2 whole blocks and a tail of 8
    cases = [(a[:45], 40), (a[:37], 36), (a[:37] + [1, 2, 3], 37), (a[:20] + [5] * 9, 20), (a[:17], 16), (a[:16], 0)]
    for prompt, covered in cases:
        dst = KVCache(1, 1, 1, 64, 1, torch.float32, "cpu")
        assert pool.read(prompt, dst, 0) == covered, prompt
        assert torch.equal(dst.k[0][0, 0, :covered, 0], src.k[0][0, 0, :covered, 0])
        assert torch.equal(dst.v[0][0, 0, :covered, 0], src.v[0][0, 0, :covered, 0])
        assert not dst.k[0][0, 0, covered:, 0].any()  # nothing past what was matched
    assert pool.store(a, src, 0, 48) == 1 and len(pool.blocks) == 3  # the whole 3rd block replaces the tail
    assert pool.read(a[:20] + [5] * 9, KVCache(1, 1, 1, 64, 1, torch.float32, "cpu"), 0) == 20
    assert pool.read(a[:45], KVCache(1, 1, 1, 64, 1, torch.float32, "cpu"), 0) == 44  # a prompt's last is left
    assert pool.store(a, src, 0, 40) == 0  # a tail the 3rd block already holds is not kept again
    assert pool.used_bytes == 3 * 2 * 16 * 4


def test_tails_are_evicted_before_their_parents():
    pool, src = PrefixPool(block_size=16, max_bytes=2 * 2 * 16 * 4, salt=b"t"), _numbered_cache()
    assert pool.store(list(range(64)), src, 0, 24) == 2  # a block and a tail of 8: the bound
    assert pool.store([7] * 64, src, 0, 16) == 1  # room: the tail goes, then nothing else is a leaf but the chain's
    assert pool.stats.evicted == 8 and len(pool.blocks) == 2
    assert all(b.parent is None or b.parent in pool.blocks for b in pool.blocks.values())
    assert all(kids <= set(pool.blocks) for kids in pool.kids.values())


def test_the_salt_separates_tenants():
    pool = _llm().prefix_cache
    pool.store(TURN1, KVCache(1, 1, 1, 64, 1, torch.float32, "cpu"), 0, 48, salt=b"alice")
    pool.store(TURN1, KVCache(1, 1, 1, 64, 1, torch.float32, "cpu"), 0, 56, salt=b"alice")  # a tail of 8
    alice, bob = pool.lookup(TURN1, salt=b"alice"), pool.lookup(TURN1, salt=b"bob")
    assert (len(alice.blocks), alice.tail_len) == (3, 8) and (bob.blocks, bob.tail, bob.tokens) == ([], None, 0)


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


def _random_head(method: str, llm: LLM):
    """An untrained head of `method` for llm's model, random weights (float32: the verifier's)."""
    from forerun.heads.checkpoint import new_head

    head = new_head(method, llm.model, **({} if method == "eagle" else {"num_heads": 3}))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head


@pytest.mark.parametrize("method", ["eagle", "medusa", "dflash"])
def test_a_head_drafter_gets_the_cached_prefixs_hidden_states(method):
    """Medusa, EAGLE and DFlash heads read the verifier's hidden states: a hit restores those of
    the cached positions with the K/V, so the head drafts what it drafts cold (the same drafts,
    the same acceptance), not only the same output."""
    warm, cold = _llm("float32"), _llm("float32", enable_prefix_caching=False)
    spec = SpeculativeConfig(method, 3, draft_model=_random_head(method, warm))
    first = warm.generate([TURN1], GREEDY, speculative=spec)[0]
    turn2 = TURN1 + first.token_ids + [7, 8, 9]
    hot, ref = warm.generate([turn2], SCORED, speculative=spec)[0], cold.generate([turn2], SCORED, speculative=spec)[0]
    assert hot.num_cached_tokens == len(TURN1) + len(first.token_ids) - 1
    assert hot.token_ids == ref.token_ids and hot.logprobs == ref.logprobs
    assert (hot.stats.drafted, hot.stats.accepted) == (ref.stats.drafted, ref.stats.accepted) and hot.stats.drafted > 0
    assert all(b.h is not None for b in warm.prefix_cache.blocks.values())
    assert warm.generate([turn2], GREEDY, speculative=None)[0].num_cached_tokens == 0  # kept apart from plain blocks
