"""A training run's checkpoint in its --out folder, beside the head itself:

  head.safetensors, head.json   the head (heads/checkpoint.py), loadable at any time
  trainer.safetensors           AdamW's moments and step counts, flattened
  trainer.json                  steps done, the run's fixed arguments, optimizer groups, history
Everything is written to a temporary name and renamed, so an interrupted save leaves the
previous checkpoint whole.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from forerun.cache import write_atomic
from forerun.errors import ConfigError
from forerun.heads.checkpoint import save_head

OPTIMIZER, TRAINER = "trainer.safetensors", "trainer.json"


def save(folder: Path, head, opt: torch.optim.Optimizer, steps: int, fixed: dict, history: list[dict], card: dict) -> None:
    from safetensors.torch import save_file

    save_head(folder, head, card.get("verifier", "?"), {**card, **fixed, "steps_done": steps})
    state = opt.state_dict()
    flat = {f"{i}.{name}": t.detach().cpu().reshape(-1 if t.dim() == 0 else t.shape).contiguous()
            for i, st in state["state"].items() for name, t in st.items()}  # (0-d step counts as [1])
    write_atomic(folder / OPTIMIZER, lambda p: save_file(flat, str(p)))
    meta = {"steps_done": steps, "fixed": fixed, "param_groups": state["param_groups"], "history": history}
    write_atomic(folder / TRAINER, lambda p: p.write_text(json.dumps(meta) + "\n"))


def exists(folder: Path) -> bool:
    return (folder / TRAINER).exists()


def load(folder: Path, head, opt: torch.optim.Optimizer, fixed: dict) -> tuple[int, list[dict]]:
    """Restore head + optimizer from `folder`; (steps done, history). Refuses a checkpoint
    of a run with other fixed arguments (data, seed, batch, schedule...)."""
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / TRAINER).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--resume: no training run in {folder} ({TRAINER} missing)") from None
    diff = {k: (meta["fixed"].get(k), v) for k, v in fixed.items() if meta["fixed"].get(k) != v}
    if diff:
        raise ConfigError("--resume: these arguments differ from the run in "
                          f"{folder} (saved, given): {diff}; resume with the same ones")
    head.load_state_dict(load_file(str(folder / "head.safetensors")))
    flat = load_file(str(folder / OPTIMIZER))
    state: dict[int, dict] = {}
    for key, t in flat.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = t.reshape(()) if name == "step" else t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta["steps_done"], meta["history"]
