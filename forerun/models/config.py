"""ModelConfig: the architecture numbers forerun's decoder needs, read from a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from forerun.errors import ModelLoadError

# model_type -> does q/k/v carry a bias. One decoder covers all of these.
LLAMA_FAMILY = {"llama": False, "mistral": False, "qwen2": True}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in LLAMA_FAMILY:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; forerun supports {sorted(LLAMA_FAMILY)}"
            )
        d = dict(d)
        rope = d.get("rope_parameters") or {}  # transformers 5 folds rope_theta in here
        d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if d.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = rope
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        d.setdefault("attention_bias", LLAMA_FAMILY[model_type])
        if model_type == "qwen2":
            d["attention_bias"] = True
        eos = d.get("eos_token_id")
        d["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        d["head_dim"] = d.get("head_dim") or 0
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ModelLoadError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ModelLoadError(f"{path} is not a valid model config: {e}") from None
