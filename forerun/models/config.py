"""ModelConfig: the architecture numbers forerun's decoders need, read from a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from forerun.errors import ModelLoadError

# model_type -> does q/k/v carry a bias. One decoder covers all of these.
LLAMA_FAMILY = {"llama": False, "mistral": False, "qwen2": True}
GEMMA3 = "gemma3_text"  # the text decoder; a multimodal "gemma3" config holds it as text_config
SUPPORTED = sorted([*LLAMA_FAMILY, GEMMA3, "gemma3"])

# Gemma3TextConfig's defaults: multimodal configs (gemma-3-4b-it...) spell out only what differs.
GEMMA3_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=131072,
    query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1, hidden_activation="gelu_pytorch_tanh",
)


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
    # Gemma 3 only (the llama family ignores them):
    sliding_window: int | None = None  # a sliding layer's query at p sees keys at p - window < pos <= p
    layer_types: tuple[str, ...] | None = None  # per layer: "sliding_attention" | "full_attention"
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar ** -0.5
    rope_local_base_freq: float = 10000.0  # RoPE base of sliding layers (rope_theta: global ones)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None
    hidden_activation: str | None = None  # "gelu_pytorch_tanh" for Gemma

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED:
            raise ModelLoadError(f"unsupported model_type {model_type!r}; forerun supports {SUPPORTED}")
        if model_type in ("gemma3", GEMMA3):
            d = _gemma3_fields(d)
            model_type = GEMMA3
        d = dict(d)
        rope = d.get("rope_parameters") or {}  # transformers 5 folds rope_theta in here
        d.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if d.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = rope
        d.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        d.setdefault("attention_bias", LLAMA_FAMILY.get(model_type, False))
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


def _gemma3_fields(d: dict) -> dict:
    """A gemma3 / gemma3_text config in the flat form ModelConfig reads.

    Fills Gemma3TextConfig's defaults, reads transformers 5's per-layer-type rope_parameters
    ({"full_attention": {...}, "sliding_attention": {...}}) and derives layer_types from the
    sliding-window pattern when absent (every pattern-th layer is global, the rest slide).
    """
    if d.get("model_type") == "gemma3":  # the outer config may say which tokens end a turn
        tokens = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
        d = {**d.get("text_config", {}), **tokens, "model_type": GEMMA3}
    d = {**GEMMA3_DEFAULTS, **d}
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional Gemma 3 (an embedding model) is not a causal decoder")
    rope = d.pop("rope_parameters", None) or {}
    if "full_attention" in rope:
        full, local = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling on sliding layers ({local['rope_type']}) is not supported")
        d["rope_theta"] = full.get("rope_theta", d["rope_theta"])
        d["rope_local_base_freq"] = local.get("rope_theta", d["rope_local_base_freq"])
        d["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    if d.get("layer_types") is None:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        d["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                            for i in range(d["num_hidden_layers"])]
    d["layer_types"] = tuple(d["layer_types"])
    if len(d["layer_types"]) != d["num_hidden_layers"]:
        listed, layers = len(d["layer_types"]), d["num_hidden_layers"]
        raise ModelLoadError(f"layer_types lists {listed} layers, the model has {layers}")
    return d
