import torch

from forerun.kv.cache import KVCache, chain_batch


def test_chain_batch_mask_is_causal_by_slot_and_pads_right():
    b = chain_batch([[5, 6, 7], [8]], [2, 0], [0, 1], torch.device("cpu"))
    assert b.tokens.tolist() == [[5, 6, 7], [8, 8, 8]]
    assert b.kv_len == 5
    m = b.mask[:, 0]
    assert m[0, 0].tolist() == [True, True, True, False, False]  # query at slot 2 sees slots 0..2
    assert m[1, 0].tolist() == [True, False, False, False, False]


def test_truncate_is_a_length_reset_and_stale_entries_are_overwritten():
    c = KVCache(1, 1, 1, 8, 2, torch.float32, "cpu")
    b = chain_batch([[1, 2, 3, 4]], [0], [0], torch.device("cpu"))
    c.write(0, b, torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    c.truncate(0, 2)
    assert c.lengths == [2]
    b2 = chain_batch([[9]], [2], [0], torch.device("cpu"))
    c.write(0, b2, torch.full((1, 1, 1, 2), 7.0), torch.full((1, 1, 1, 2), 7.0))
    assert c.k[0][0, 0, :4, 0].tolist() == [1, 1, 7, 1]  # slot 3 stale until written, masked meanwhile


def test_rows_subset_read_and_move_compaction():
    c = KVCache(2, 3, 1, 6, 1, torch.float64, "cpu")
    for layer in range(2):
        c.k[layer][:, 0, :, 0] = torch.arange(18, dtype=torch.float64).view(3, 6)
        c.v[layer].copy_(c.k[layer])
    b = chain_batch([[0], [0]], [2, 3], [2, 0], torch.device("cpu"))
    k, _ = c.read(0, b)
    assert k[:, 0, :, 0].tolist() == [[12, 13, 14, 15], [0, 1, 2, 3]]
    c.move(1, [4, 5], [2, 3])  # accepted tree path at slots 4, 5 -> consecutive slots 2, 3
    assert c.k[1][1, 0, :, 0].tolist() == [6, 7, 10, 11, 10, 11]
    assert c.v[0][1, 0, :, 0].tolist() == [6, 7, 10, 11, 10, 11]


def test_write_prefixes_in_small_chunks_equals_one_forward():
    from forerun.prefill import PrefixWrite, write_prefixes
    from tests.tiny import tiny_model

    m = tiny_model()
    items = [PrefixWrite(0, 0, list(range(1, 12))), PrefixWrite(1, 0, [5, 6, 7]), PrefixWrite(2, 2, [8, 9, 10, 11])]
    one, chunked = m.new_cache(3, 16), m.new_cache(3, 16)
    for c in (one, chunked):  # row 2 starts at slot 2: give it a prefix first
        write_prefixes(m, c, [PrefixWrite(2, 0, [3, 4])])
    write_prefixes(m, one, items, budget=4096)
    write_prefixes(m, chunked, items, budget=3)
    for layer in range(2):  # compare written slots only: padding leaves stale entries past them
        for row, end in ((0, 11), (1, 3), (2, 6)):
            torch.testing.assert_close(one.k[layer][row, :, :end], chunked.k[layer][row, :, :end])
            torch.testing.assert_close(one.v[layer][row, :, :end], chunked.v[layer][row, :, :end])


def test_both_caches_keep_the_one_protocol_and_say_their_dtype():
    """LLM's row cache and the server's paged pool are the same kind of thing to a model
    (kv/protocol.py); the backend reads `dtype` to leave a 16-bit cache to torch."""
    from forerun.kv.paged import PagedKVCache
    from forerun.kv.protocol import KVStore
    from tests.tiny import tiny_model

    model = tiny_model(dtype="float32")
    rows = KVCache(1, 2, 1, 8, 2, torch.float16, "cpu")
    paged = PagedKVCache(model, rows=2, capacity=20, num_blocks=5, block_size=4)
    assert isinstance(rows, KVStore) and isinstance(paged, KVStore)
    assert rows.dtype == torch.float16 and paged.dtype == torch.float32
