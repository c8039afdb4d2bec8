"""The fidelity record: what `forerun quality` measured, keyed by the model's weights, read back
beside every speed (`generate`, `cost`, `bench`, `eval`, `serve`)."""
import doctest
import json
import os

import pytest

from forerun.bench import fidelity
from forerun.bench.quality import QualityRow
from forerun.gguf.convert import SOURCE_FILE

ROWS = [QualityRow("float32", 3.4563, 1530, 0.0, 0.0, 1.0), QualityRow("int4", 3.4908, 1530, 1.0, 0.0084, 0.971),
        QualityRow("llama.cpp (m.gguf)", 3.4551, 1530, -0.03)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(fidelity, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def test_doctests():
    assert doctest.testmod(fidelity).failed == 0


def test_rows_saved_are_read_back_and_shown(tmp_path, cache):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    path = fidelity.save(folder, "hf", ROWS, "argparse, difflib, textwrap", 512, 6)
    assert path.parent == cache / fidelity.RECORD_DIR
    rows = fidelity.load(folder)
    assert set(rows) == {"float32", "int4", "llama.cpp"}
    assert rows["int4"]["kl"] == 0.0084 and rows["int4"]["ctx"] == 512 and rows["llama.cpp"]["kl"] is None
    line = fidelity.describe(rows, "int4", "hf")
    assert line.startswith("fidelity of int4: perplexity +1.00% vs float32, mean KL 0.0084, top-1 agreement 97.1%")
    assert "not measured" in fidelity.describe(rows, "gguf", "hf")  # a precision never measured: the command
    assert rows["int4"]["kernels"] == fidelity.kernels_digest()  # these kernels: shown as measured
    assert fidelity.describe(rows, "int4", "hf", fidelity.kernels_digest()) == line
    assert "measure it again" in fidelity.describe(rows, "int4", "hf", "other sources")
    assert "the reference" in fidelity.describe(rows, "float32", "hf", "other sources")  # torch's, not the kernels'
    assert "--model '/a b'" in fidelity.describe(rows, "gguf", "/a b")  # a command that can be pasted


def test_a_later_measurement_replaces_only_its_own_rows(tmp_path, cache):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    fidelity.save(folder, "hf", ROWS, "t", 512, 6)
    fidelity.save(folder, "hf", [QualityRow("int4", 3.5, 62, 1.3, 0.01, 0.95)], "u", 64, 2)
    rows = fidelity.load(folder)
    assert rows["int4"]["tokens"] == 62 and rows["int4"]["text"] == "u" and rows["float32"]["tokens"] == 1530


def test_other_weights_have_no_record(tmp_path, cache):
    folder = tmp_path / "hf"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weights")
    fidelity.save(folder, "hf", ROWS, "t", 512, 6)
    weights.write_bytes(b"fine-tuned weights")  # new bytes, new size: another model
    assert fidelity.load(folder) == {}
    empty = tmp_path / "nothing"
    empty.mkdir()
    assert fidelity.save(empty, "x", ROWS, "t", 512, 6) is None and fidelity.load(empty) == {}
    assert fidelity.load(None) == {}


def test_a_converted_folder_is_keyed_by_its_gguf(tmp_path, cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF blocks")
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / SOURCE_FILE).write_text(json.dumps({"path": str(gguf)}))
    fidelity.save(folder, "m", ROWS, "t", 512, 6)
    (folder / "model.safetensors").write_bytes(b"float32 copy written on first use")  # changes nothing
    assert fidelity.load(folder)["int4"]["tokens"] == 1530
    os.utime(gguf, ns=(1, 1))  # the GGUF replaced (another mtime): its old record no longer applies
    assert fidelity.load(folder) == {}


def test_an_unreadable_record_is_no_record(tmp_path, cache):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    path = fidelity.record_path(folder)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert fidelity.load(folder) == {}
    assert fidelity.save(folder, "hf", ROWS, "t", 512, 6) == path and "int4" in fidelity.load(folder)
