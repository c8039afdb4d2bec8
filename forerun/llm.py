"""The Python API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import numbers
import warnings

from dataclasses import dataclass
from typing import Callable

import torch

from forerun.config import SamplingParams, SpeculativeConfig, check_dtype
from forerun.precision import Precision
from forerun.drafters.base import Drafter
from forerun.engine import GenerateJob, generate
from forerun.errors import ConfigError, ContextLengthError
from forerun.logprobs import TokenLogprobs, check_count, prompt_logprobs, with_text
from forerun.metrics import SpecStats
from forerun.streaming import TextStream, hits_stop, stop_index

_DEFAULT = object()  # "use the LLM's speculative config"


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (EOS included when the model emitted it)
    text: str  # decoded generated text, cut before a matched stop string
    finish_reason: str  # "stop" or "length"
    stats: SpecStats
    # Why a "length" finish stopped: "max_tokens" (as asked) or "context" (the model's context
    # filled up before max_tokens); None for "stop".
    finish_detail: str | None = None
    # SamplingParams(logprobs=N): one {token id: Logprob} per generated token (the chosen one and
    # the N most likely, raw log-probabilities: forerun/logprobs.py), and their sum.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    # SamplingParams(prompt_logprobs=N): the same per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache (vLLM's RequestOutput field)."""
        return self.stats.cached_tokens


class LLM:
    """A verifier model, its tokenizer and a default speculative config.

    model: None (embedded SmolLM2-135M-Instruct), an embedded model's name ("gemma3-270m"),
    a HF folder, a .gguf file, a hub id, or an already built decoder module (LlamaForCausalLM,
    Gemma3ForCausalLM; then pass tokenizer= or use token-id prompts).

    enable_prefix_caching: keep the KV blocks of each generate call's prompts and answers (at
    most prefix_cache_gb) and reuse them when a later prompt starts with the same tokens (a
    chat's next turn). None (the default): on where the precision is batch-invariant (gguf,
    int8, int4, float32 on forerun's kernels), so a hit never changes a token; elsewhere
    (bfloat16, float32 without the kernels, accelerators) a hit may change tokens, so it is
    opt-in (True).

    kv_cache_dtype: the KV cache's dtype. "auto" (the default): the activations' (float32 for
    gguf, int8, int4 and float32); "float16": half the KV memory and half the attention reads at
    long contexts, lossy (it rounds every key and value to float16), still batch-invariant
    (a prefix-cache hit, a chunked prefill and speculative decoding keep plain decoding's bits).
    Float32 activations only. A draft model follows it (drafters/draft_model.py).
    """

    def __init__(
        self,
        model=None,
        dtype: str = "auto",
        speculative: SpeculativeConfig | None = None,
        tokenizer=None,
        device: str = "cpu",
        progress: bool = True,
        enable_prefix_caching: bool | None = None,
        prefix_cache_gb: float = 1.0,
        kv_cache_dtype: str = "auto",
    ):
        self.dtype = check_dtype(dtype)
        if isinstance(model, torch.nn.Module):  # an already built forerun decoder
            self.model, self.tokenizer = model, tokenizer  # dtype then only labels its precision
            self.source, self.name = None, "in-memory"
            self.dtype = "float32" if dtype == "auto" else dtype
            kernels = getattr(getattr(model, "backend", None), "name", "torch") == "cpu-kernels"
            self.precision = Precision(self.dtype, str(model.device), kernels=kernels, gguf_blocks=False,
                                       kv_cache=kv_cache_dtype)
            if kv_cache_dtype != "auto":  # (on the module itself: its caches are made by model.new_cache)
                model.set_kv_cache(kv_cache_dtype)
        else:
            from forerun.models.loader import load_model, resolve_model_dir, resolve_precision
            from forerun.tokenizer import Tokenizer

            folder = resolve_model_dir(model, progress=progress)
            self.source, self.name = folder, folder.name
            self.tokenizer = tokenizer or Tokenizer.from_pretrained(folder)
            # "auto": gguf for a quantized GGUF, else float32
            self.precision = resolve_precision(dtype, folder, device, kv_cache=kv_cache_dtype)
            self.dtype = self.precision.name
            self.model = load_model(folder, self.precision)
        self.speculative = speculative
        self.prefix_cache = self.new_prefix_pool(enable_prefix_caching, prefix_cache_gb)
        self._drafter_cache: tuple[SpeculativeConfig, Drafter] | None = None
        self._grammars = None  # structured.GrammarCompiler, made on the first structured request
        self._cost_curves: dict[int, tuple[list[float], float]] = {}  # k_max -> (verify cost [k_max + 1], 1-token s)

    @property
    def max_context(self) -> int:
        return self.model.config.max_position_embeddings

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | None = None,
        speculative=_DEFAULT,
        stream: Callable[[int, str], None] | None = None,
    ) -> list[CompletionOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists (batched together).

        stream(seq_index, text_delta) is called as text becomes final (stop strings excluded).
        """
        params = sampling_params or SamplingParams()
        spec = self.speculative if speculative is _DEFAULT else speculative
        ids = self.encode(prompts)
        job = GenerateJob(ids, params, self._budgets(ids, params), eos_ids=self.eos_ids(), prefix=self.prefix_cache)
        if params.structured is not None:
            job.grammar = self.compile_grammar(params.structured)
        if spec is not None and spec.enabled:
            job.drafter, job.k, job.typical = self.drafter_for(spec), spec.k_max, spec.typical_rule
            job.forced_drafts, job.continue_forced = spec.forced_drafts, spec.continue_forced
            if spec.adaptive:
                job.k_policy = self._k_policy(spec.k_max, spec.options.get("verify_cost"))
        if params.stop:
            job.should_stop = lambda i, gen: hits_stop(self.decode, gen, params.stop)
        if stream is not None:
            job.on_tokens = TextStream(self.decode, params.stop, stream).update
        outs = [self._output(s, params) for s in generate(self.model, job)]
        if params.prompt_logprobs is not None:
            for out in outs:
                out.prompt_logprobs = self.score_prompt(out.prompt_token_ids, params.prompt_logprobs)
        return outs

    def score_prompt(self, ids: list[int], top: int = 0) -> list[TokenLogprobs | None]:
        """Teacher-forced logprobs of a token-id sequence: None for the first token, then each
        token's raw log-probability under the model given the tokens before it, with the `top`
        most likely alternatives (vLLM's prompt_logprobs)."""
        check_count("prompt_logprobs", top)
        (ids,) = self.encode([ids])
        if len(ids) > self.max_context:
            raise ContextLengthError(f"prompt is {len(ids)} tokens; the model's context is {self.max_context} tokens")
        with torch.inference_mode():
            logits = self.model.score(ids)
        return with_text(prompt_logprobs(logits, ids, top), self.token_text)

    def chat(self, messages, sampling_params=None, speculative=_DEFAULT, stream=None) -> list[CompletionOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params, speculative, stream)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt for `messages` (and the tools the model may call: OpenAI's tools[] entries)."""
        self.require_tokenizer()
        if tools:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # -- helpers -----------------------------------------------------------------------
    def encode(self, prompts) -> list[list[int]]:
        """Validated token ids for a string, a list of strings or token-id lists (as generate takes)."""
        accepted = "a string, a list of strings, a list of token ids, or a list of token-id lists"
        if not isinstance(prompts, (str, list, tuple)):
            raise ConfigError(f"prompts must be {accepted}; got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ConfigError("no prompts given")
        out = []
        for p in prompts:
            if not isinstance(p, (str, list, tuple)) or (not isinstance(p, str) and not all(map(_is_token_id, p))):
                raise ConfigError(f"prompts must be {accepted}; got an element of type {type(p).__name__}")
            if isinstance(p, str):
                if not p:  # (a tokenizer that adds BOS would make a one-token prompt of it)
                    raise ConfigError("empty prompt: give the text to continue")
                self.require_tokenizer()
                p = self.tokenizer.encode(p, add_special_tokens=not _starts_with_special(p, self.tokenizer))
            p = [int(t) for t in p]
            if not p:
                raise ConfigError("empty prompt")
            if max(p) >= self.model.config.vocab_size or min(p) < 0:
                raise ConfigError(f"prompt token id outside the vocabulary [0, {self.model.config.vocab_size})")
            out.append(p)
        return out

    def _budgets(self, ids: list[list[int]], params: SamplingParams) -> list[int]:
        budgets = []
        for p in ids:
            room = self.max_context - len(p)
            if room < 1:
                raise ContextLengthError(
                    f"prompt is {len(p)} tokens; the model's context is {self.max_context} tokens "
                    "(shorten the prompt or use a model with a longer context)"
                )
            budgets.append(min(params.max_tokens, room))
        return budgets

    def new_prefix_pool(self, enable: bool | None, gb: float, block_size: int = 16, warn: bool = True):
        """A prefix cache (kv/prefix.py) for this model, or None where it is off: enable None
        means on where hits are bit-exact (the precision is batch-invariant). LLM keeps one
        across generate calls; the server makes its own at its block size (warn False: the LLM
        already said that a hit may change tokens when it made its own)."""
        from forerun.kv.prefix import PrefixPool

        if enable is None:
            enable = self.precision.batch_invariant
        if not enable:
            return None
        if warn and not self.precision.batch_invariant:  # asked for: said once, where it is made
            warnings.warn(f"prefix caching at {self.precision.name} on {self.model.device}: its prefill and its "
                          "decoding round differently, so a cache hit may change tokens (on by default only at gguf, "
                          "int8, int4 and float32 on the kernels)", RuntimeWarning, stacklevel=3)
        if not 0 < gb < float("inf"):
            raise ConfigError(f"prefix_cache_gb must be a finite number > 0, got {gb!r}")
        return PrefixPool(block_size=block_size, max_bytes=int(gb * 2**30), salt=self.prefix_salt())

    def prefix_salt(self) -> bytes:
        """What every prefix-cache key of this model carries: the model, its precision, the KV dtype."""
        c = self.model.config
        shape = f"{c.model_type}|{c.num_hidden_layers}x{c.hidden_size}"
        return f"{self.name}|{shape}|{self.precision.name}|kv={self.model.kv_dtype}".encode()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (vLLM's reset_prefix_cache); returns how many."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a sequence: the model config's and the tokenizer's."""
        ids = set(self.model.config.eos_token_id)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    def _k_policy(self, k_max: int, given: list[float] | None = None):
        """A fresh adaptive-k controller over this model's measured cost curve (measured once
        per LLM and k_max: a few forwards of 1 .. k_max + 1 tokens), or over `given`
        (options["verify_cost"]: cost of scoring 1 .. k_max + 1 tokens relative to one)."""
        from forerun.adaptive import AdaptiveK

        if given is not None:
            if len(given) < k_max + 1:
                raise ConfigError(f"options['verify_cost'] needs k_max + 1 = {k_max + 1} values, got {len(given)}")
            return AdaptiveK(k_max, [float(c) for c in given[: k_max + 1]], forward_s=0.0)
        if k_max not in self._cost_curves:
            from forerun.cost_curve import measure

            ms = measure(self.model, list(range(1, k_max + 2)), context=64, repeats=2)
            self._cost_curves[k_max] = ([ms[t] / ms[1] for t in range(1, k_max + 2)], ms[1] / 1e3)
        verify_cost, forward_s = self._cost_curves[k_max]
        return AdaptiveK(k_max, verify_cost, forward_s=forward_s)

    def drafter_for(self, spec: SpeculativeConfig) -> Drafter:
        """The drafter `spec` names, over this LLM as its verifier (the server's scheduler and
        the tools share it). Built once per config object; only the latest is kept (a draft
        model is big)."""
        if self._drafter_cache is None or self._drafter_cache[0] is not spec:
            from forerun.drafters import build_drafter  # (imports every drafter: only when one is used)

            self._drafter_cache = (spec, build_drafter(spec.method, spec=spec, verifier=self))
        return self._drafter_cache[1]

    def decode(self, ids: list[int]) -> str:
        """The text of generated token ids (special tokens skipped); "" without a tokenizer."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, s, params: SamplingParams) -> CompletionOutput:
        text = self.decode(s.generated)
        cut = stop_index(text, params.stop)
        detail = None
        if s.finish_reason == "length":
            detail = "context" if len(s.generated) < params.max_tokens else "max_tokens"
        out = CompletionOutput(s.tokens[: s.prompt_len], s.generated, text if cut is None else text[:cut], s.finish_reason,
                               s.stats, detail)
        if s.logprobs is not None:
            out.logprobs = with_text(s.logprobs, self.token_text)
            out.cumulative_logprob = sum(e[t].logprob for e, t in zip(s.logprobs, s.generated))
        return out

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included), for Logprob.decoded_token."""
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else ""

    def compile_grammar(self, spec):
        """spec (structured.StructuredOutputs) compiled for this tokenizer, cached (the first one
        builds the tokenizer's table: about a second for 150k tokens). A FieldError (a
        ConfigError naming the field) where the engine cannot compile or enforce it."""
        self.require_tokenizer()
        if not hasattr(self.tokenizer, "backend_json"):
            from forerun.errors import FieldError

            raise FieldError(spec.field, "this model's tokenizer has no tokenizer.json for a grammar's token table")
        if self._grammars is None:
            from forerun.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars.compile(spec)

    def require_tokenizer(self) -> None:
        """Raises ConfigError where this LLM has no tokenizer (text prompts need one)."""
        if self.tokenizer is None:
            raise ConfigError("this LLM has no tokenizer: pass token-id prompts")


def _is_token_id(t) -> bool:
    """Python and NumPy integers, or a one-element integer tensor."""
    if isinstance(t, numbers.Integral):
        return True
    return isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point()


def _starts_with_special(text: str, tokenizer) -> bool:
    """A chat-templated prompt already carries its BOS; do not add a second one."""
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and text.startswith(bos)

