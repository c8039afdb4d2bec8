"""Layer-skip profiles: which layers a model's self-speculative drafter skips.

Looked up in order: the user's tuned profile (`forerun tune-skip` writes it under the
cache dir), then a default shipped with forerun for the embedded model. Never searched
implicitly: a search costs minutes and its result should be a deliberate artefact.
"""
from __future__ import annotations

import json
from pathlib import Path

from forerun.errors import ConfigError

SHIPPED = Path(__file__).resolve().parent.parent / "profiles"


def profile_name(llm) -> str:
    return f"{llm.name}.layer_skip.json"


def user_profile_path(llm) -> Path:
    from forerun.cache import cache_dir

    return cache_dir() / "profiles" / profile_name(llm)


def load_skip_set(llm) -> list[int]:
    for path in (user_profile_path(llm), SHIPPED / profile_name(llm)):
        if path.exists():
            prof = json.loads(path.read_text())
            if prof.get("num_hidden_layers") != llm.model.config.num_hidden_layers:
                raise ConfigError(f"layer-skip profile {path} was made for another architecture; re-run `forerun tune-skip`")
            return list(prof["skip"])
    raise ConfigError(
        f"no layer-skip profile for model {llm.name!r}: run `forerun tune-skip --model ...` once "
        "(a few minutes), or pass skip_layers=... / --skip-layers"
    )


def save_profile(llm, profile: dict) -> Path:
    path = user_profile_path(llm)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2))
    return path
