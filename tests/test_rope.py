"""RoPE by table lookup (rope.RopeTable) gives rope_cos_sin's values bit for bit."""
import torch

from forerun.models.rope import RopeTable, inv_frequencies, rope_cos_sin
from tests.tiny import tiny_model


def test_table_equals_direct_computation():
    for head_dim, theta, angle_dtype, out_dtype in [(64, 1e6, torch.float32, torch.float32),
                                                     (128, 1e4, torch.float32, torch.float32),
                                                     (64, 1e4, torch.float64, torch.float64),
                                                     (32, 1e4, torch.float32, torch.bfloat16)]:
        inv = inv_frequencies(head_dim, theta, None).to(angle_dtype)
        table = RopeTable(inv, out_dtype, size=64)
        g = torch.Generator().manual_seed(0)
        for positions in [torch.tensor([[0]]), torch.arange(5, 13)[None], torch.randint(0, 64, (3, 7), generator=g),
                          torch.tensor([[63, 64, 4999]])]:  # the last grows the table
            cos, sin = table(positions)
            want_cos, want_sin = rope_cos_sin(positions, inv, out_dtype)
            assert cos.shape == want_cos.shape == (*positions.shape[:1], 1, positions.shape[1], head_dim)
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert len(table.cos) >= 5000


def test_model_forward_uses_a_fresh_table_after_inv_freq_changes():
    model = tiny_model(dtype="float32")
    positions = torch.arange(3)[None]
    first = model._rope(positions, torch.float32)[0]
    model.inv_freq = model.inv_freq * 0.5  # e.g. a loader's rope scaling
    second = model._rope(positions, torch.float32)[0]
    assert torch.equal(second, rope_cos_sin(positions, model.inv_freq.float(), torch.float32)[0])
    assert not torch.equal(first[..., 1:, :], second[..., 1:, :])
