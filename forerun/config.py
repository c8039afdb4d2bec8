"""User-facing parameter contracts, validated once at construction.

Each dataclass is frozen: the engine never mutates what the user passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from forerun.errors import ConfigError, did_you_mean
from forerun.methods import METHODS, NONE

DTYPES = ("auto", "float32", "bfloat16", "int8", "int4", "float64", "gguf")
# "auto": gguf (the file's own quantized blocks) for a model loaded from a quantized GGUF on the
# CPU, else float32 (models.loader.resolve_dtype).
ACCEPTANCE = ("exact", "typical_lossy")  # the lossy rule says so in its name


# A repetition penalty divides positive logits: below this the quotient leaves float32 (a
# penalty of 1e-300 is 0 there, and l / 0 is inf or NaN), and nobody means a value so small.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature == 0 means greedy (argmax).

    The same params shape the verifier's p during verification as during plain
    sampling, which is what makes speculative sampling exact.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k cut
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities (vLLM's fields): for each generated / prompt token its raw log-probability
    # and those of the N most likely tokens (forerun/logprobs.py); None = not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output (forerun.structured.StructuredOutputs: a JSON schema, regex, choice or
    # grammar the output must follow, enforced token by token); None: free text.
    structured: object | None = None
    # forerun/penalties.py: added to a token's logit; OpenAI's penalties on output tokens; vLLM's
    # repetition penalty on prompt and output tokens (1 = none)
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        from forerun.logprobs import check_count

        check_count("logprobs", self.logprobs)
        check_count("prompt_logprobs", self.prompt_logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ConfigError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], got {self.repetition_penalty}")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or tok < 0 or not -100.0 <= bias <= 100.0:
                raise ConfigError(f"logit_bias maps token ids (integers >= 0) to values in [-100, 100], got {tok!r}: {bias!r}")
        if self.structured is not None:
            from forerun.structured.spec import StructuredOutputs

            if not isinstance(self.structured, StructuredOutputs):
                raise ConfigError(f"structured must be a forerun.structured.StructuredOutputs, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TypicalRule:
    """Medusa's typical acceptance (Cai et al. 2024). LOSSY: the output no longer follows the
    verifier's distribution. A drafted token x is kept where the verifier finds it typical
    enough, p(x) > min(epsilon, alpha * exp(-H(p))), whatever the drafter's q; the token
    after the kept prefix is drawn from p itself. Under greedy decoding forerun never uses
    it (greedy verification is exact and as fast)."""

    epsilon: float = 0.09  # the threshold's cap (Medusa's posterior_threshold)
    alpha: float = 0.3  # scales exp(-entropy) (Medusa: sqrt(epsilon))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens and how many per step.

    method: a name in forerun/methods.py ("ngram", "draft_model", ...), or None for plain decoding.
    num_speculative_tokens: k, the longest draft per verifier forward (0 = plain decoding), or
        "auto": each row picks k in [0, options["k_max"]] every step (forerun/adaptive.py).
    draft_model: path / hub id / "default" for method="draft_model", or an already built LLM-like
        object exposing `.model` and `.tokenizer`.
    ngram_max / ngram_min: the n-gram drafter's match window (longest first).
    ngram_branches / tree_width: propose token trees instead of chains (see verify.tree_verify).
    """

    method: str | None = "ngram"
    num_speculative_tokens: int | str = 5
    draft_model: object | None = None
    draft_dtype: str | None = None  # default (a drafter named by path): int4 on the CPU with the kernels (drafters/draft_model.py)
    ngram_max: int = 4
    ngram_min: int = 2  # 1-token matches are mostly noise: measured 1.13x -> 1.23x on a dev split
    ngram_branches: int = 1  # >1: up to this many distinct n-gram continuations, verified as a tree
    tree_width: int = 1  # draft_model: >1 candidates for the first drafted position (a tree)
    skip_layers: tuple[int, ...] | None = None  # layer_skip: layers to skip (default: the tuned profile)
    exit_layer: int | None = None  # early_exit: draft with layers [0, exit_layer) (default: half)
    quant_bits: int = 8  # quantized: weight bits of the self-draft copy
    lookahead_window: int = 5  # lookahead: Jacobi window W (guesses fed per step)
    lookahead_ngram: int = 3  # lookahead: n-gram size N gathered from the iterations
    lookahead_pool: int = 4  # lookahead: pool candidates G verified per step
    # "exact" (rejection sampling: the verifier's distribution) or "typical_lossy" (Medusa's
    # typical acceptance, TypicalRule below: more tokens kept when sampling, output law changed;
    # options["typical_epsilon"], options["typical_alpha"]). Greedy decoding is exact either way.
    acceptance: str = "exact"
    options: dict = field(default_factory=dict)  # drafter-specific extras, by name

    def __post_init__(self):
        k = self.num_speculative_tokens if self.num_speculative_tokens != "auto" else self.k_max
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"num_speculative_tokens (k) must be an integer >= 0 or 'auto', got {self.num_speculative_tokens!r}")
        if k > 64:
            raise ConfigError(f"num_speculative_tokens (k) = {k} is absurd; use at most 64")
        if self.adaptive and k < 1:
            raise ConfigError("options['k_max'] for num_speculative_tokens='auto' must be >= 1")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.skip_layers is not None:
            object.__setattr__(self, "skip_layers", tuple(sorted(set(int(i) for i in self.skip_layers))))
        if self.ngram_branches < 1 or self.tree_width < 1:
            raise ConfigError("ngram_branches and tree_width must be >= 1")
        if self.method is not None and (self.method == NONE or self.method not in METHODS):
            plain = " (plain decoding is method=None)" if self.method == NONE else did_you_mean(self.method, METHODS)
            raise ConfigError(f"unknown speculative method {self.method!r}; available: {sorted(set(METHODS) - {NONE})}{plain}")
        draft_vocab = self.options.get("draft_vocab")
        if draft_vocab is not None and (not isinstance(draft_vocab, int) or draft_vocab < 0 or draft_vocab == 1):
            raise ConfigError(f"options['draft_vocab'] must be an integer >= 2 (ids the drafter scores) or 0 (all), "
                              f"got {draft_vocab!r}")
        if self.options.get("head_dtype") not in (None, "float32", "int8", "int4"):
            raise ConfigError(f"options['head_dtype'] must be float32, int8 or int4 (a head drafter's layers and a "
                              f"reduced draft head), got {self.options['head_dtype']!r}")
        if not isinstance(self.options.get("draft_vocab_context", True), bool):
            raise ConfigError("options['draft_vocab_context'] must be true or false (score the context's ids too)")
        if self.acceptance not in ACCEPTANCE:
            raise ConfigError(f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        eps, alpha = self.options.get("typical_epsilon", 0.09), self.options.get("typical_alpha", 0.3)
        if not (isinstance(eps, (int, float)) and 0 < eps < 1 and isinstance(alpha, (int, float)) and alpha > 0):
            raise ConfigError(f"typical acceptance needs 0 < typical_epsilon < 1 and typical_alpha > 0, got {eps!r}, {alpha!r}")
        if self.draft_dtype is not None and self.draft_dtype not in DTYPES:
            raise ConfigError(f"draft_dtype must be one of {DTYPES}, got {self.draft_dtype!r}")

    @property
    def adaptive(self) -> bool:
        """num_speculative_tokens="auto": k chosen per row and step (forerun/adaptive.py)."""
        return self.num_speculative_tokens == "auto"

    @property
    def typical_rule(self) -> TypicalRule | None:
        """The TypicalRule of acceptance="typical_lossy", else None (exact)."""
        if self.acceptance != "typical_lossy":
            return None
        return TypicalRule(self.options.get("typical_epsilon", 0.09), self.options.get("typical_alpha", 0.3))

    @property
    def k_max(self) -> int:
        """The longest draft: k itself, or options["k_max"] (default 8) under "auto"."""
        return self.options.get("k_max", 8) if self.adaptive else self.num_speculative_tokens

    @property
    def forced_drafts(self) -> bool:
        """A structured output's forced tokens lead each draft (options["grammar_drafts"], default true)."""
        return bool(self.options.get("grammar_drafts", True))

    @property
    def continue_forced(self) -> bool:
        """A token-only drafter drafts on after those tokens (options["grammar_continue"], default true)."""
        return bool(self.options.get("grammar_continue", True))

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.k_max > 0


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
