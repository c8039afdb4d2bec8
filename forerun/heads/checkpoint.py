"""A trained head on disk: `head.safetensors` (weights) + `head.json` (what it is, which
verifier it belongs to, how it was trained).

head.json:
  {"format": "forerun-head", "version": 1, "method": "eagle" | "medusa" | "dflash",
   "config": {...EagleConfig / MedusaConfig / DFlashConfig fields...},
   "verifier": {"fingerprint": "<16 hex>", "name": "...", "vocab_size": V, "hidden_size": H},
   "training": {...free-form: data, steps, seed, held-out accuracy...}}
A head is loaded only onto the verifier whose fingerprint it carries (heads/fingerprint.py).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from torch import nn

from forerun.cache import write_atomic
from forerun.errors import ConfigError, ModelLoadError
from forerun.heads.dflash import DFlashConfig, DFlashHead
from forerun.heads.eagle import EagleConfig, EagleHead
from forerun.heads.fingerprint import verifier_fingerprint
from forerun.heads.medusa import MedusaConfig, MedusaHeads

WEIGHTS, CARD = "head.safetensors", "head.json"
KINDS: dict[str, tuple[type, type]] = {"medusa": (MedusaConfig, MedusaHeads), "eagle": (EagleConfig, EagleHead),
                                       "dflash": (DFlashConfig, DFlashHead)}


def new_head(method: str, verifier_model, **config) -> nn.Module:
    """A freshly initialised head of `method` shaped for `verifier_model` (float32, on its
    device), tagged with the verifier's fingerprint. config overrides e.g. num_heads."""
    if method not in KINDS:
        raise ConfigError(f"no trainable head for method {method!r}; heads: {sorted(KINDS)}")
    cfg_cls, head_cls = KINDS[method]
    head = head_cls(cfg_cls.for_verifier(verifier_model.config, **config))
    head.verifier_fingerprint = verifier_fingerprint(verifier_model)
    return head.to(verifier_model.device)


def save_head(folder: str | Path, head: nn.Module, verifier_name: str, training: dict | None = None) -> Path:
    """Write head.safetensors + head.json into `folder` (created), atomically per file."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}
    write_atomic(folder / WEIGHTS, lambda p: save_file(state, str(p)))
    card = {
        "format": "forerun-head", "version": 1, "method": head.kind,
        "config": {k: v for k, v in vars(head.config).items()},
        "verifier": {"fingerprint": head.verifier_fingerprint, "name": verifier_name,
                     "hidden_size": head.config.hidden_size},
        "training": training or {},
    }
    write_atomic(folder / CARD, lambda p: p.write_text(json.dumps(card, indent=2) + "\n"))
    return folder


def read_card(folder: str | Path) -> dict:
    path = Path(folder) / CARD
    try:
        card = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} is not a forerun head: no {CARD} (train one with `forerun train`)") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if card.get("format") != "forerun-head" or card.get("method") not in KINDS:
        raise ModelLoadError(f"{path} is not a forerun head card (format {card.get('format')!r}, method {card.get('method')!r})")
    return card


def load_head(source, method: str, verifier_model) -> nn.Module:
    """A head for `verifier_model` from a folder written by save_head, or an in-memory head
    (new_head's); refused (ConfigError) when it is another method's or another verifier's."""
    if source is None:
        raise ConfigError(f"method {method!r} needs draft_model= a head folder (from `forerun train --method {method}`)")
    if isinstance(source, nn.Module):
        head, where = source, "the given head"
    else:
        head, where = _read(Path(source)), str(source)
    if head.kind != method:
        raise ConfigError(f"{where} is a {head.kind} head, not {method}")
    want = verifier_fingerprint(verifier_model)
    if head.verifier_fingerprint != want:
        raise ConfigError(
            f"{where} was trained for another verifier (fingerprint {head.verifier_fingerprint}, "
            f"this model's is {want}); train a head for this model with `forerun train --method {method} --model ...`"
        )
    return head.to(verifier_model.device).eval().requires_grad_(False)


def _read(folder: Path) -> nn.Module:
    from safetensors.torch import load_file

    card = read_card(folder)
    cfg_cls, head_cls = KINDS[card["method"]]
    try:
        head = head_cls(cfg_cls(**card["config"]))
        head.load_state_dict(load_file(str(folder / WEIGHTS)))
    except (TypeError, ValueError, RuntimeError, OSError, ConfigError) as e:
        raise ModelLoadError(f"cannot load the head in {folder}: {str(e).splitlines()[0]}") from None
    head.verifier_fingerprint = card["verifier"]["fingerprint"]
    return head


def at_verifier_precision(head: nn.Module, spec, verifier) -> nn.Module:
    """The head in the verifier's dtype, its linears quantised to int8 rows when the verifier
    runs at int8 or int4 (options["head_dtype"]: "float32" keeps them float). A draft token of
    a Qwen2.5-1.5B EAGLE head is a 1536-wide decoder layer, 200 MB at float32: about a fifth
    of an int8 verifier forward, where the int8 copy reads a quarter of that. Drafts only:
    verification is untouched, so output stays exact."""
    from forerun.linears.int8 import quantize_int8_

    head = head.to(verifier.model.dtype)
    want = spec.options.get("head_dtype", verifier.dtype)
    if want not in ("float32", "int8", "int4"):
        raise ConfigError(f"options['head_dtype'] must be float32, int8 or int4, got {want!r}")
    if want not in ("int8", "int4"):
        return head
    head = copy.deepcopy(head)  # (an in-memory head stays float)
    if getattr(head, "kind", None) in ("eagle", "dflash"):  # fc reads [features; embeddings]
        from forerun.heads.eagle import SplitInputLinear

        head.fc = SplitInputLinear(head.fc, head.fc.out_features)  # a range per half (see there)
    return quantize_int8_(head)
