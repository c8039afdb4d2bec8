"""int8 / int4 of a quantized GGUF file are quantized straight from its blocks, one matrix at a
time (models/loader.py: requantize_), never from a float32 copy of the whole model, which is
neither written to the cache nor held in memory (the 0.5B's int4 load: 5.6 -> under 3 GB
resident): int8 the same model, bit for bit, as quantizing that copy; int4 the file's own Q4_K
blocks kept and every other matrix as int4 of that copy fits it."""
import dataclasses
import pytest
import torch

from forerun.llm import LLM
from forerun.models import loader
from forerun.kernels import loader as kernel_loader

pytestmark = pytest.mark.skipif(kernel_loader.load() is None or not hasattr(kernel_loader.load(), "gguf_rows"),
                                reason="reading GGUF blocks needs the compiled kernels")

from forerun.linears.gguf import GGUFEmbedding, GGUFLinear  # noqa: E402
from forerun.linears.int8 import Int8Linear  # noqa: E402
from tests.test_gguf_native import PROMPTS, write_quantized_gguf  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_from_the_blocks_equals_int8_from_the_float32_copy(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_quantized_gguf(path, seed=5, arch=arch)
    native = LLM(str(path), dtype="int8", progress=False)
    model = native.model
    assert not any(native.source.glob("*.safetensors"))  # no float32 copy written
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert not any(isinstance(m, GGUFLinear) for m in model.modules())

    real = loader.resolve_precision  # the float32 copy's way: as if the file's blocks could not be read
    monkeypatch.setattr(loader, "resolve_precision", lambda *a, **k: dataclasses.replace(real(*a, **k), gguf_blocks=False))
    copy = LLM(str(path), dtype="int8", progress=False)
    assert any(copy.source.glob("*.safetensors"))
    for ids in PROMPTS:
        assert torch.equal(model.score(ids), copy.model.score(ids))
    a, b = model.model.layers[1].mlp.down_proj, copy.model.model.layers[1].mlp.down_proj
    assert torch.equal(a.weight_int8, b.weight_int8) and torch.equal(a.weight_scale, b.weight_scale)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_keeps_the_files_q4k_blocks_and_fits_the_others_as_from_the_float32_copy(tmp_path, monkeypatch, arch):
    """Every linear of the tiny file has whole blocks of 256 inputs, so int4 is Q4_K throughout:
    the file's Q4_K parts byte for byte (never re-quantized), its other parts (Q5_K, Q6_K, Q8_0,
    Q4_0 ...) fitted from their dequantized values, as int4 of the float32 copy fits them."""
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_quantized_gguf(path, seed=5, arch=arch)
    file = LLM(str(path), dtype="gguf", progress=False).model
    int4 = LLM(str(path), dtype="int4", progress=False)
    assert not any(int4.source.glob("*.safetensors"))  # no float32 copy written
    real = loader.resolve_precision  # the float32 copy's way: as if the file's blocks could not be read
    monkeypatch.setattr(loader, "resolve_precision", lambda *a, **k: dataclasses.replace(real(*a, **k), gguf_blocks=False))
    copy = LLM(str(path), dtype="int4", progress=False).model
    names = [n for n, m in file.named_modules() if isinstance(m, GGUFLinear)]
    assert "lm_head" in names and len(names) == 1 + 4 * len(file.model.layers)
    kept = 0
    for name in names:
        f, q, c = file.get_submodule(name), int4.model.get_submodule(name), copy.get_submodule(name)
        assert isinstance(q, GGUFLinear) and {p.type for p in q.parts} == {12} and {p.type for p in c.parts} == {12}
        start = 0
        for fp, qp in zip(f.parts, q.parts):
            rows = torch.arange(start, start + fp.rows)
            if fp.type == 12:
                assert torch.equal(qp.data, (fp.pack() if qp.packed_rows else fp).data)  # (packed as a whole-Q4_K linear)
                kept += 1
            else:
                assert torch.equal(qp.dequantize(), c.float_rows(rows))
            start += fp.rows
    assert kept >= 2  # the file's Q4_K: layer 0's q, the last layer's gate
