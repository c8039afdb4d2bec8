"""The per-query attention's SIMD path without AVX512 (attend_group_avx2, where the build has AVX2
and FMA: a group's queries over K and V a chunk of keys at a time) gives the bits of its plain
C++ definition (attend_one_scalar, one query over all its keys): the same 16-lane dot
products and sums, the same exp without contraction, the same two output chains.

`set_attention_reference(True)` sends every query through the definition; each case is run
both ways and compared with torch.equal: key counts with and without a 16-key tail, odd and
even, a single key, head sizes 32, 64 and 128, a chain (attend_prefix), a token tree
(attend_masked), float32 and float16 caches, and a paged pool read through its tables. Where
the build has AVX512 (its own path, not this one) or no AVX2, both runs take the same code.
"""
import pytest
import torch

from forerun.kernels import loader as kernel_loader
from tests.test_paged_kernels import pool_of

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")


def both_ways(fn):
    """fn() on the build's path, then on the plain C++ definition."""
    kernel = kernel_loader.load()
    fast = fn()
    old = kernel.set_attention_reference(True)
    try:
        plain = fn()
    finally:
        kernel.set_attention_reference(old)
    return fast, plain


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_chain_and_tree_attention_give_the_definitions_bits(D, dtype):
    kernel = kernel_loader.load()
    torch.manual_seed(D)
    H, Hkv, cap = 6, 2, 300
    k, v = (torch.randn(3, Hkv, cap, D) * 2).to(dtype), torch.randn(3, Hkv, cap, D).to(dtype)
    rows = torch.tensor([1, 2, 0])
    T = 6
    q = torch.randn(3, H, T, D) * 3
    limits = torch.tensor([[1, 2, 3, 15, 16, 17], [31, 32, 33, 64, 65, 299], [100, 101, 128, 129, 255, 300]])
    fast, plain = both_ways(lambda: kernel.attend_prefix(q, k, v, rows, limits, D**-0.5))
    assert torch.equal(fast, plain)
    mask = torch.rand(3, T, cap) < 0.3
    mask[:, :, 0] = True
    mask[0, 0] = False
    mask[0, 0, 5] = True  # a node that sees one key
    fast, plain = both_ways(lambda: kernel.attend_masked(q, k, v, rows, mask, D**-0.5))
    assert torch.equal(fast, plain)


@pytest.mark.parametrize("bs", [16, 6])
def test_a_paged_pool_gives_the_definitions_bits(bs):
    kernel = kernel_loader.load()
    torch.manual_seed(bs)
    D, H, Hkv, cap = 64, 4, 2, 96
    k, v = torch.randn(2, Hkv, cap, D), torch.randn(2, Hkv, cap, D)
    (kp, tables), (vp, _) = pool_of(k, bs), pool_of(v, bs)
    q = torch.randn(2, H, 3, D)
    limits = torch.tensor([[40, 41, 96], [1, 9, 50]])
    rows = torch.tensor([1, 0])
    fast, plain = both_ways(lambda: kernel.attend_prefix(q, kp, vp, rows, limits, D**-0.5, tables))
    assert torch.equal(fast, plain)
    assert torch.equal(fast, kernel.attend_prefix(q, k, v, rows, limits, D**-0.5))


def test_large_scores_and_far_below_the_max_keep_the_definitions_bits():
    """Scores far apart: exps that reach the -87 floor, and a key that takes nearly all the weight."""
    kernel = kernel_loader.load()
    torch.manual_seed(1)
    D = 64
    k, v = torch.randn(1, 1, 80, D), torch.randn(1, 1, 80, D)
    k[0, 0, 7] *= 60
    q = torch.randn(1, 2, 2, D) * 20
    limits = torch.tensor([[80, 33]])
    fast, plain = both_ways(lambda: kernel.attend_prefix(q, k, v, torch.tensor([0]), limits, D**-0.5))
    assert torch.equal(fast, plain)
