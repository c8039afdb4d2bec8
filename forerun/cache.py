"""Where forerun keeps what it fetches and derives (models, converted folders, GGUF indexes,
kernels built at run time): FORERUN_CACHE_DIR, else the platform's user cache folder; and how a
file forerun writes there (or in a checkpoint folder) appears: whole, or not at all."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

CACHE_ENV = "FORERUN_CACHE_DIR"


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("forerun"))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) to `path`.tmp beside it, then rename it over `path`: a reader (or a run
    killed halfway) never finds a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)
