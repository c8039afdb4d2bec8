"""What one training run is: every knob of `forerun train`, validated once."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from forerun.errors import ConfigError

METHODS = ("medusa", "eagle", "dflash")
PRECISIONS = ("float32", "bfloat16")
# Arguments a resumed run must share with the run it continues (the rest may change).
FIXED_ON_RESUME = ("method", "num_heads", "data", "seq_len", "max_tokens", "eval_chunks", "seed", "batch", "lr", "steps", "warmup", "vocab", "unroll", "intermediate_size")


@dataclass
class TrainConfig:
    method: str  # "medusa" | "eagle" | "dflash"
    out: str  # folder: head.safetensors + head.json, trainer state, features cache, loss.png
    data: list[str] = field(default_factory=list)  # files, folders, or pkg:NAME (an installed package's source + docs)
    model: str | None = None  # the verifier (as LLM(model=...) takes it)
    dtype: str = "float32"  # the verifier's precision while computing targets
    device: str = "cpu"
    num_heads: int = 4  # medusa: heads; dflash: block positions (tokens drafted per step at most)
    seq_len: int = 256  # tokens per training chunk
    max_tokens: int = 200_000  # tokens read from the data at most
    eval_chunks: int = 8  # held-out chunks (the last ones after a seeded shuffle)
    batch: int = 4  # chunks per optimizer step
    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 20  # steps of linear warm-up; then linear decay to 10% at `steps`
    eval_every: int = 50
    save_every: int = 100
    seed: int = 0
    unroll: int = 1  # eagle: training-time test steps (EAGLE-3): steps 2.. continue from the head's own guesses
    intermediate_size: int | None = None  # eagle / dflash: the head's MLP width (default: the verifier's)
    vocab: int | None = None  # score the loss over ids 0..N-1 + special ids only (FR-Spec); serve with draft_vocab N
    precision: str = "float32"  # the training step's matmuls: "bfloat16" runs them under torch.autocast
    max_minutes: float | None = None  # stop (saving a checkpoint) after this long; --resume continues
    resume: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not self.data:
            raise ConfigError("--data: give at least one text source (a file, a folder, or pkg:NAME)")
        for name in ("seq_len", "max_tokens", "eval_chunks", "batch", "steps", "eval_every", "save_every", "num_heads", "unroll"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.vocab is not None and self.vocab < 2:
            raise ConfigError(f"--vocab must be >= 2 (or unset for the whole vocabulary), got {self.vocab}")
        if self.intermediate_size is not None:
            if self.method == "medusa":
                raise ConfigError("--intermediate-size is for eagle and dflash heads (a Medusa head is one H x H block)")
            if self.intermediate_size < 1:
                raise ConfigError(f"--intermediate-size must be >= 1 (or unset for the verifier's), got {self.intermediate_size}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.seq_len < 4 or not self.lr > 0 or self.warmup < 0:
            raise ConfigError("--seq-len must be >= 4, --lr > 0 and --warmup >= 0")

    def fixed(self) -> dict:
        """The fields a resumed run must share with its checkpoint."""
        return {k: v for k, v in asdict(self).items() if k in FIXED_ON_RESUME}
