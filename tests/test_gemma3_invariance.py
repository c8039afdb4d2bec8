"""Gemma 3 at the batch-invariant precisions (float32 and int8 with the compiled kernels, and
linears over GGUF blocks): a token gets the same bits whether it is scored alone, among k
drafted tokens, beside other rows, or as a token-tree node. The sliding window (8) is shorter
than the prefix, so the per-query kernel must apply it. Under a forced CPU level (test_isa_levels)
torch's SDPA tiles queries differently by their number: only the per-query path holds there."""
import numpy as np
import pytest
import torch
from torch import nn

from forerun.kernels.backend import CpuKernels
from forerun.kv.cache import chain_batch, tree_batch
from forerun.kernels import loader as kernel_loader
from forerun.models.config import ModelConfig
from forerun.models.gemma3 import Gemma3ForCausalLM
from forerun.models.loader import finish_model

KERNEL = kernel_loader.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="needs forerun's compiled kernels")

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16, model_type="gemma3_text", tie_word_embeddings=True)


def _random_model() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(ModelConfig(**TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.05 if name.endswith("norm.weight") else 0.3)
    return model


def _gguf_linears_(model: nn.Module) -> None:
    """Every linear of the layers over Q8_0 / Q5_1 blocks quantized from its own weights."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from forerun.linears.gguf import Blocks, GGUFLinear

    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    t = T.Q8_0 if i % 2 else T.Q5_1
                    data = quants.quantize(child.weight.detach().numpy().astype(np.float32), t)
                    setattr(parent, name, GGUFLinear([Blocks(torch.from_numpy(data), int(t), child.in_features)]))
    model.set_backend(CpuKernels(KERNEL))


def _model(precision: str) -> Gemma3ForCausalLM:
    if precision == "gguf":
        model = finish_model(_random_model(), "float32", "cpu")
        if not hasattr(KERNEL, "gguf_rows"):
            pytest.skip("kernels without gguf_rows")
        _gguf_linears_(model)
        return model
    return finish_model(_random_model(), precision, "cpu")


PREFIX = torch.randint(0, 64, (21,), generator=torch.Generator().manual_seed(1)).tolist()
NEXT = [5, 9, 33, 2, 61]


@pytest.fixture(scope="module", params=["float32", "int8", "gguf"])
def model(request):
    return _model(request.param)


def _one_by_one(model, prefix, tokens):
    cache = model.new_cache(1, 64)
    model(chain_batch([prefix], [0], [0], model.device), cache, logits_at=None)
    outs = []
    for i, t in enumerate(tokens):
        outs.append(model(chain_batch([[t]], [len(prefix) + i], [0], model.device), cache).logits[0, 0])
    return torch.stack(outs)


def test_k_tokens_scored_at_once_get_the_bits_of_one_at_a_time(model):
    with torch.no_grad():
        alone = _one_by_one(model, PREFIX, NEXT)
        cache = model.new_cache(1, 64)
        model(chain_batch([PREFIX], [0], [0], model.device), cache, logits_at=None)
        together = model(chain_batch([NEXT], [len(PREFIX)], [0], model.device), cache).logits[0]
    assert torch.equal(together, alone)


def test_a_row_gets_its_bits_beside_a_longer_row(model):
    other = torch.randint(0, 64, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        alone = _one_by_one(model, PREFIX, NEXT[:2])
        cache = model.new_cache(2, 64)
        model(chain_batch([PREFIX, other], [0, 0], [0, 1], model.device), cache, logits_at=None)
        both = model(chain_batch([NEXT[:2], NEXT], [len(PREFIX), len(other)], [0, 1], model.device), cache).logits
    assert torch.equal(both[0, :2], alone)


def test_tree_nodes_get_their_chains_bits(model):
    nodes, parents = [7, 11, 13, 17, 19], [-1, 0, 0, 1, 2]  # branches 0 -> 1 -> 3 and 0 -> 2 -> 4
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        model(chain_batch([PREFIX], [0], [0], model.device), cache, logits_at=None)
        tree = model(tree_batch([nodes], [parents], [len(PREFIX)], [0], model.device), cache).logits[0]
        for branch in ([0, 1, 3], [0, 2, 4]):
            assert torch.equal(tree[branch], _one_by_one(model, PREFIX, [nodes[i] for i in branch]))
