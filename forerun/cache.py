"""Where forerun keeps what it fetches and derives (models, converted folders, GGUF indexes,
kernels built at run time): FORERUN_CACHE_DIR, else the platform's user cache folder."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FORERUN_CACHE_DIR"


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("forerun"))
