"""The GGUF index (gguf/index.py): a file is parsed by GGUFReader once per version; later
loads read the cached index and only the tensor bytes, and get the same model."""
import os

import pytest
import torch

from forerun.llm import LLM
from forerun.kernels import loader as kernel_loader

pytestmark = pytest.mark.skipif(kernel_loader.load() is None or not hasattr(kernel_loader.load(), "gguf_rows"),
                                reason="reading GGUF blocks needs the compiled kernels")

from forerun.gguf import index as gguf_index  # noqa: E402
from tests.test_gguf_native import PROMPTS, write_quantized_gguf  # noqa: E402


def count_parses(monkeypatch) -> list:
    import gguf

    opened = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: (opened.append(path), real(path, *a, **k))[1])
    return opened


def test_a_second_load_reads_the_cached_index_not_the_file_header(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, seed=2)
    first = LLM(str(path), dtype="gguf", progress=False)  # converts (config, tokenizer), indexes
    assert len(list((tmp_path / "cache" / "gguf_index").glob("tiny-*.json"))) == 1
    gguf_index._MEMO.clear()  # as a new process
    opened = count_parses(monkeypatch)
    again = LLM(str(path), dtype="gguf", progress=False)
    assert opened == []
    for ids in PROMPTS:
        assert torch.equal(first.model.score(ids), again.model.score(ids))
    assert LLM(str(path), dtype="int4", progress=False) and opened == []  # int4 from the blocks too


def test_a_changed_file_is_indexed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, seed=2)
    before = gguf_index.gguf_index(path)
    write_quantized_gguf(path, seed=3, arch="qwen2")  # other tensors (q/k/v biases): another index
    os.utime(path, ns=(1, 1))
    opened = count_parses(monkeypatch)
    after = gguf_index.gguf_index(path)
    assert len(opened) == 1 and after.architecture == "qwen2" and after != before
    assert len(list((tmp_path / "cache" / "gguf_index").glob("tiny-*.json"))) == 2


def test_an_unreadable_index_is_rebuilt_and_a_bad_file_still_refused(tmp_path, monkeypatch):
    from forerun.errors import ModelLoadError

    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, seed=2)
    index = gguf_index.gguf_index(path)
    (stored,) = (tmp_path / "cache" / "gguf_index").glob("tiny-*.json")
    stored.write_text("{not json")
    gguf_index._MEMO.clear()
    assert gguf_index.gguf_index(path) == index
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_index.gguf_index(bad)


def test_a_rewrite_keeping_size_and_time_is_caught_by_the_header_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(path, seed=2)
    gguf_index.gguf_index(path)
    st = path.stat()
    data = bytearray(path.read_bytes())
    at = data.index("Ġthe".encode())
    data[at + 3] = ord("x")  # a token's text in the metadata: same size, another header
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    gguf_index._MEMO.clear()
    opened = count_parses(monkeypatch)
    gguf_index.gguf_index(path)
    assert len(opened) == 1  # the cached index was refused, the file read again
    gguf_index._MEMO.clear()
    gguf_index.gguf_index(path)
    assert len(opened) == 1  # and the new one cached


def test_a_missing_file_is_a_clear_error(tmp_path):
    from forerun.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not found"):
        gguf_index.gguf_index(tmp_path / "absent.gguf")
