"""int8 / int4 of a quantized GGUF file are quantized straight from its blocks, one matrix at a
time (models/loader.py: requantize_), never from a float32 copy of the whole model:
the same model, bit for bit, as quantizing that copy, without writing it to the cache or
holding it in memory (the 0.5B's int4 load: 5.6 -> under 3 GB resident)."""
import pytest
import torch

from forerun.llm import LLM
from forerun.models import int8_kernel, loader

pytestmark = pytest.mark.skipif(int8_kernel.load() is None or not hasattr(int8_kernel.load(), "gguf_rows"),
                                reason="reading GGUF blocks needs the compiled kernels")

from forerun.models.gguf_native import GGUFEmbedding, GGUFLinear  # noqa: E402
from forerun.models.quant import Int8Linear  # noqa: E402
from tests.test_gguf_native import PROMPTS, write_quantized_gguf  # noqa: E402


def int4_q4k(module) -> bool:
    """int4's form of a linear whose inputs are whole blocks of 256: one part of Q4_K blocks."""
    return isinstance(module, GGUFLinear) and [p.type for p in module.parts] == [12]


@pytest.mark.parametrize("dtype, linear", [("int8", lambda m: isinstance(m, Int8Linear)), ("int4", int4_q4k)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_from_the_blocks_equals_quantized_from_the_float32_copy(tmp_path, monkeypatch, dtype, linear, arch):
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_quantized_gguf(path, seed=5, arch=arch)
    native = LLM(str(path), dtype=dtype, progress=False)
    model = native.model
    assert not any(native.source.glob("*.safetensors"))  # no float32 copy written
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert all(linear(m) for m in (model.lm_head, model.model.layers[0].self_attn.qkv_proj,
                                   model.model.layers[-1].mlp.gate_up_proj))  # (the file's: Q4_K + Q5_K + Q6_K, Q4_K + Q6_K)
    assert all(linear(m) for m in model.modules() if isinstance(m, GGUFLinear))  # none kept as the file has it

    monkeypatch.setattr(loader, "_from_blocks", lambda folder, device: False)  # the float32 copy's way
    copy = LLM(str(path), dtype=dtype, progress=False)
    assert any(copy.source.glob("*.safetensors"))
    for ids in PROMPTS:
        assert torch.equal(model.score(ids), copy.model.score(ids))
    a, b = model.model.layers[1].mlp.down_proj, copy.model.model.layers[1].mlp.down_proj
    if dtype == "int8":
        assert torch.equal(a.weight_int8, b.weight_int8) and torch.equal(a.weight_scale, b.weight_scale)
    else:
        assert torch.equal(a.parts[0].data, b.parts[0].data)
