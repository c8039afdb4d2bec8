"""The kernels read and write the server's paged pool in place, through its block tables.

A row's slot s lives at offset s % block_size of block tables[row][s // block_size]; the
kernels (attend_prefix, attend_masked, rope_write_attend, the one-call layer and the layer
stack) take the pool and the tables instead of a gathered copy. The plain C++ path reads blocks
of a power of two >= 4 slots where they lie and copies others a block at a time into scratch
(as the AVX512 path copies every pool); either way each query must see the values of the row
cache in the same order: torch.equal against the same K/V laid out as rows, for both routes,
float32 and float16 pools, and through whole models with the gather and torch's writes made to
fail (the kernels really took the forward).
"""
import random

import pytest
import torch

from forerun.kernels import loader as kernel_loader
from forerun.kv.cache import chain_batch, tree_batch
from forerun.kv.paged import PagedKVCache
from tests.test_serve_paged import scattered_cache
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")
H, HKV, D, ROWS, CAP = 6, 2, 32, 3, 96


def pool_of(rows: torch.Tensor, bs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, Hkv, cap, D] laid out as a pool [blocks + 2, Hkv, bs, D] in shuffled blocks, and
    the tables [R, cap / bs] that read it back (blocks 0 and 1 belong to nobody: garbage)."""
    R, Hkv, cap, Dh = rows.shape
    width = cap // bs
    ids = list(range(2, 2 + R * width))
    random.Random(seed).shuffle(ids)
    pool = torch.randn(2 + R * width, Hkv, bs, Dh).to(rows.dtype)
    tables = torch.tensor(ids, dtype=torch.long).view(R, width)
    for r in range(R):
        for i in range(width):
            pool[tables[r, i]] = rows[r, :, i * bs : (i + 1) * bs]
    return pool, tables


def unpool(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """pool_of's inverse: rows [R, Hkv, width * bs, D]."""
    return torch.stack([torch.cat([pool[b] for b in t.tolist()], dim=1) for t in tables])


# bs 16 and 4: read in place on the plain C++ path; 6 (not a power of two) and 2: copied
BLOCKS = [16, 4, 6, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("bs", BLOCKS)
def test_attention_over_a_pool_equals_attention_over_rows(bs, dtype):
    kernel = kernel_loader.load()
    torch.manual_seed(bs)
    k, v = torch.randn(ROWS, HKV, CAP, D).to(dtype), torch.randn(ROWS, HKV, CAP, D).to(dtype)
    (kp, tables), (vp, _) = pool_of(k, bs), pool_of(v, bs)
    T, rows = 5, torch.tensor([2, 0])  # batch entries on rows 2 and 0
    q = torch.randn(2, H, T, D)
    limits = torch.tensor([[90, 91, 92, 93, 94], [1, 17, 33, 50, 51]])
    want = kernel.attend_prefix(q, k, v, rows, limits, D**-0.5)
    assert torch.equal(kernel.attend_prefix(q, kp, vp, rows, limits, D**-0.5, tables), want)
    mask = torch.rand(2, T, CAP) < 0.4
    mask[:, :, 0] = True
    want = kernel.attend_masked(q, k, v, rows, mask, D**-0.5)
    assert torch.equal(kernel.attend_masked(q, kp, vp, rows, mask, D**-0.5, tables), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("bs", BLOCKS)
def test_rope_write_attend_writes_and_reads_a_pool_as_rows(bs, dtype):
    kernel = kernel_loader.load()
    torch.manual_seed(100 + bs)
    k, v = torch.randn(ROWS, HKV, CAP, D).to(dtype), torch.randn(ROWS, HKV, CAP, D).to(dtype)
    (kp, tables), (vp, _) = pool_of(k, bs, seed=1), pool_of(v, bs, seed=1)
    B, T = 2, 4
    qkv = torch.randn(B, T, (H + 2 * HKV) * D)
    cos, sin = torch.rand(B, 1, T, D), torch.rand(B, 1, T, D)
    rows, slots = torch.tensor([1, 2]), torch.tensor([[40, 41, 42, 43], [7, 8, 9, 10]])
    want = kernel.rope_write_attend(qkv, cos, sin, k, v, rows, slots, H, HKV, D**-0.5)
    got = kernel.rope_write_attend(qkv, cos, sin, kp, vp, rows, slots, H, HKV, D**-0.5, tables)
    assert torch.equal(got, want)
    assert torch.equal(unpool(kp, tables), k) and torch.equal(unpool(vp, tables), v)  # the writes landed alike


def test_a_table_entry_outside_the_pool_is_refused():
    kernel = kernel_loader.load()
    k = torch.zeros(4, HKV, 8, D)  # 4 blocks of 8 slots
    tables = torch.tensor([[0, 4]])  # slots 8.. of row 0 would be in block 4: none
    q = torch.zeros(1, H, 1, D)
    kernel.attend_prefix(q, k, k, torch.tensor([0]), torch.tensor([[8]]), 1.0, tables)  # (block 0 only: fine)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.attend_prefix(q, k, k, torch.tensor([0]), torch.tensor([[12]]), 1.0, tables)


@pytest.fixture
def kernels_only(monkeypatch):
    """A paged cache that neither gathers its blocks nor lets torch attend over them."""

    def fail(*_):
        raise AssertionError("the paged cache was gathered for torch")

    monkeypatch.setattr(PagedKVCache, "_gather", fail)
    monkeypatch.setattr(PagedKVCache, "read", fail)


@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
@pytest.mark.parametrize("kv", ["auto", "float16"])
def test_a_model_over_the_pool_gives_the_row_caches_bits_through_the_kernels(dtype, kv, kernels_only):
    """A prompt, a ragged chain step on rows out of order, a token tree and its compaction, and
    a step after it: the paged pool's logits are the row cache's, and nothing gathered the pool."""
    model = tiny_model(seed=3, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    model.set_kv_cache(kv)
    paged, rows = scattered_cache(model, 2, 160, bs=16), model.new_cache(2, 160)
    prompt = [(3 * i * i + 5 * i + 1) % 61 + 1 for i in range(100)]
    out = []
    with torch.inference_mode():
        for cache in (paged, rows):
            whole = model(chain_batch([prompt, prompt[:33]], [0, 0], [0, 1], model.device), cache).logits
            step = model(chain_batch([[5], [3, 4]], [33, 100], [1, 0], model.device), cache).logits
            tree = model(tree_batch([[9, 1, 2, 6]], [[-1, 0, 0, 1]], [34], [1], model.device), cache).logits
            cache.move(1, [35, 37], [35, 36])
            after = model(chain_batch([[7], [8]], [102, 37], [0, 1], model.device), cache).logits
            out.append((whole, step, tree, after))
    for a, b in zip(*out):
        assert torch.equal(a, b)
