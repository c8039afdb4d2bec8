"""A prompt's K/V and logits are the same bits however it is computed: one long prefill, chunks
of any size, or one token at a time (decoding). This is what lets a cached prefix stand in for
a computed one (a prefix-cache hit never changes a token) and makes chunked prefill exact.

Every query attends on its own through the per-query kernel, a prompt's included (before, rows
of 64 or more new tokens went through SDPA's flash kernel, whose bits differ from decoding's);
the linears compute each token on its own at any count. Checked with torch.equal on K, V and
logits, at each kernel precision, and for Gemma 3's masked kernel; and the check keeps its
power: with prompts through SDPA (`prefill_sdpa`) the K/V differ.
"""
import dataclasses

import pytest
import torch

from forerun.kernels import loader as kernel_loader
from forerun.kv.cache import chain_batch
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")
PROMPT = [(7 * i * i + 3 * i + 1) % 61 + 1 for i in range(150)]  # 150 tokens: past WIDE_ROWS (64)


def _model(dtype: str):
    return tiny_model(seed=4, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                      max_position_embeddings=512)


def run(model, ids: list[int], chunks: list[int]):
    """K/V of every layer and the last position's logits after feeding `ids` in `chunks`."""
    cache = model.new_cache(1, len(ids) + 1)
    start, logits = 0, None
    with torch.inference_mode():
        for n in chunks:
            out = model(chain_batch([ids[start : start + n]], [start], [0], model.device), cache)
            logits, start = out.logits[0, -1], start + n
    assert start == len(ids)
    keys = [k[0, :, : len(ids)].clone() for k in cache.k]
    values = [v[0, :, : len(ids)].clone() for v in cache.v]
    return keys, values, logits


def assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
def test_whole_chunked_and_decoded_prefill_give_the_same_bits(dtype):
    model = _model(dtype)
    whole = run(model, PROMPT, [150])
    assert_same(whole, run(model, PROMPT, [64, 64, 22]))  # chunks of the scheduler's size
    assert_same(whole, run(model, PROMPT, [100, 1, 49]))  # a long chunk, one token, the rest
    assert_same(whole, run(model, PROMPT, [70] + [1] * 80))  # then decoding, token by token


def test_prompt_rows_through_sdpa_differ_from_decoding():
    """The test's power: SDPA over a prompt row gives K/V other bits than the per-query path."""
    model = _model("int8")
    whole = run(model, PROMPT, [150])
    model.set_backend(dataclasses.replace(model.backend, prefill_sdpa=True))
    sdpa = run(model, PROMPT, [150])
    assert any(not torch.equal(x, y) for x, y in zip(whole[0] + whole[1], sdpa[0] + sdpa[1]))


def test_a_batch_of_long_and_short_rows_gives_each_its_alone_bits():
    model = _model("int8")
    alone = [run(model, p, [len(p)])[2] for p in (PROMPT, PROMPT[:90], PROMPT[:5])]
    cache = model.new_cache(3, 151)
    prompts = [PROMPT, PROMPT[:90], PROMPT[:5]]
    with torch.inference_mode():
        out = model(chain_batch(prompts, [0, 0, 0], [0, 1, 2], model.device), cache)
    for i, p in enumerate(prompts):
        assert torch.equal(out.logits[i, len(p) - 1], alone[i])


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_gemmas_masked_layers_give_a_prompt_the_same_bits_whole_chunked_and_decoded(dtype):
    """Gemma 3's layers (sliding windows among them) attend through the masked per-query kernel,
    a prompt's rows too: whole, chunked and decoded prefills give the same K, V and logits."""
    from tests.test_gemma3_invariance import _model as gemma

    model = gemma(dtype)
    ids = [(5 * i + 3) % 60 + 1 for i in range(100)]  # past WIDE_ROWS and the tiny model's window
    whole = run(model, ids, [100])
    assert_same(whole, run(model, ids, [64, 36]))
    assert_same(whole, run(model, ids, [70] + [1] * 30))
