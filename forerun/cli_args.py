"""What every `forerun` command shares, below all of them (cli.py, bench/, serve/ import it; it
imports none of them): the parser with one-line errors, the help formatter, the model /
sampling / drafter flags, the configs built from them, and errors worded in those flags.
No torch here: `forerun --help` stays light."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from forerun.errors import ForerunError, did_you_mean

MODELS = ("model folder, .gguf file, hub id, or embedded name: smollm2-135m (the default), gemma3-270m, "
          "qwen2.5-coder-1.5b, qwen2.5-coder-0.5b")
DTYPES = ["auto", "gguf", "float32", "bfloat16", "int8", "int4"]
KV_CACHE_DTYPES = ["auto", "float32", "float16"]
KV_CACHE_HELP = ("the KV cache's dtype; auto: the activations' (float32 for gguf, int8, int4, float32); float16 halves "
                 "KV memory and attention reads, lossy: rounds K/V to float16 (still batch-invariant; float32 activations only)")
# Names other tools use for a precision, and forerun's nearest one (difflib finds no such match).
DTYPE_ALIASES = {"fp16": "bfloat16", "half": "bfloat16", "bf16": "bfloat16", "fp32": "float32", "f32": "float32",
                 "q8": "int8", "q4": "int4"}
# Python parameters (SamplingParams, SpeculativeConfig and its options) named by a flag of another name.
PARAMETER_FLAGS = {"max_tokens": "max_new_tokens", "num_speculative_tokens (k)": "k", "num_speculative_tokens": "k"}


class Parser(argparse.ArgumentParser):
    """argparse, with a bad value said in one line or two: the error, the choices and the near
    miss among them, then where the help is (not the command's whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every option)\n")

    def _check_value(self, action, value):
        if action.choices is None or value in action.choices:
            return
        choices = [str(c) for c in action.choices]
        raise argparse.ArgumentError(action, f"invalid choice {value!r}; choose from {', '.join(choices)}{near_miss(value, choices)}")


def near_miss(value, choices) -> str:
    """did_you_mean's hint, or the precision another tool's name means (fp16 -> bfloat16).
    >>> near_miss("fp16", DTYPES), near_miss("flot32", DTYPES), near_miss("x", DTYPES)
    (" (did you mean 'bfloat16'?)", " (did you mean 'float32'?)", '')
    """
    alias = DTYPE_ALIASES.get(str(value).lower())
    return did_you_mean(value, choices) or (f" (did you mean {alias!r}?)" if alias in choices else "")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default said once: argparse's "(default: X)" only where the help does not
    already say its default and there is one to show (not None, not an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def k_arg(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def int_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ForerunError(f"expected comma-separated integers, got {text!r}") from None


def add_common(p: argparse.ArgumentParser):
    """The model, sampling and drafter flags of generate, compare, bench, drift and serve."""
    p.add_argument("--model", default=None, help=MODELS)
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="verifier precision; auto: gguf (the file's own quantized blocks) for a quantized GGUF model, else float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_HELP)
    p.add_argument("--method", default="ngram",
                   help="drafter: ngram, draft_model, layer_skip, early_exit, quantized, lookahead, "
                        "medusa, eagle, dflash (trained heads: --draft-model DIR from `forerun train`); none = plain. "
                        "`forerun methods` says what each does")
    p.add_argument("--k", type=k_arg, default=5,
                   help="speculative tokens per step (0 = plain decoding), or 'auto': chosen per step from measured acceptance and cost")
    p.add_argument("--k-max", type=int, default=8, help="the longest draft under --k auto")
    p.add_argument("--draft-model", default=None,
                   help="draft model for --method draft_model (same forms as --model); the head folder for medusa / eagle / dflash")
    p.add_argument("--draft-dtype", default=None, choices=DTYPES,
                   help="draft model's precision (default: int4 on the CPU with the kernels, the fastest measured, "
                        "which changes acceptance, never the output; else the verifier's)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ngram-max", type=int, default=4, help="ngram: longest n-gram matched in the context")
    p.add_argument("--ngram-min", type=int, default=2, help="ngram: shortest n-gram matched")
    p.add_argument("--ngram-branches", type=int, default=1, help="ngram: verify up to N matches as a token tree")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft_model: score only the first N token ids (+ special tokens, + the ids of each row's prompt "
                        "and output so far) in the drafter's head; 0 = all (default: 32768 for a draft model with over "
                        "65536 ids; heads: the ids they were trained over)")
    p.add_argument("--head-dtype", default=None, choices=["float32", "int8", "int4"],
                   help="medusa / eagle / dflash: the head's layers and its reduced output head (--draft-vocab); draft_model: "
                        "its reduced head (default: the verifier's / the draft model's dtype). Drafts only: the output stays exact")
    p.add_argument("--tree-width", type=int, default=1,
                   help="draft_model: candidates at the first position (a tree); medusa / eagle / dflash: top candidates per node (a tree of 16 nodes)")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="draft_model / quantized: stop a draft where the drafter's top token probability falls below this (0 = never)")
    p.add_argument("--draft-lookup", type=int, default=None, metavar="N",
                   help="draft_model: the first drafter forward also checks prompt lookup's guess (after the last N.."
                        "--ngram-max tokens seen before): one forward drafts every guessed token the drafter agrees with "
                        "(0 = off) (default: 1)")
    p.add_argument("--suffix-cache-requests", type=int, default=None, metavar="N",
                   help="suffix: earlier requests' outputs kept to draft from, per process, oldest out first (default: 256)")
    p.add_argument("--suffix-min-score", type=float, default=None,
                   help="suffix with --draft-model: a row drafts from its suffix tree when the tree's expected accepted "
                        "tokens reach this, else from the draft model (default: 1.0)")
    p.add_argument("--no-grammar-drafts", action="store_true",
                   help="structured outputs: do not lead drafts with the tokens a grammar forces (to measure what they give)")
    p.add_argument("--skip-layers", default=None, help="layer_skip: comma-separated layers (default: tuned profile)")
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: draft with the first N layers (default: half)")
    p.add_argument("--quant-bits", type=int, default=8, choices=[8, 4], help="quantized: the self-draft's weight bits (int8 or int4)")
    p.add_argument("--lookahead-window", type=int, default=5, help="lookahead: Jacobi window (guesses per step)")
    p.add_argument("--lookahead-ngram", type=int, default=3, help="lookahead: n-gram size gathered from the iterations")
    p.add_argument("--lookahead-pool", type=int, default=4, help="lookahead: pool candidates verified per step")
    p.add_argument("--acceptance", default="exact", choices=["exact", "typical_lossy"],
                   help="exact: rejection sampling, the verifier's distribution; typical_lossy: Medusa's typical "
                        "acceptance when sampling (more tokens kept, output distribution CHANGED)")
    p.add_argument("--typical-epsilon", type=float, default=0.09,
                   help="typical_lossy: keep x where p(x) > min(epsilon, sqrt(epsilon) * exp(-entropy))")


def configs(args):
    """(SamplingParams, SpeculativeConfig) from add_common's flags."""
    import sys

    from forerun.config import SamplingParams, SpeculativeConfig

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, **({"max_tokens": args.max_new_tokens} if args.max_new_tokens is not None else {}),
    )
    method = None if args.method in ("none", "plain") else args.method
    if method is not None and args.k == 0:  # ("auto" is not 0)
        print(f"forerun: --k 0 turns speculation off: plain decoding (method {method} unused)", file=sys.stderr)
    spec = SpeculativeConfig(
        method=method, num_speculative_tokens=args.k, draft_model=args.draft_model, draft_dtype=args.draft_dtype,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min, ngram_branches=args.ngram_branches,
        tree_width=args.tree_width, skip_layers=int_list(args.skip_layers), exit_layer=args.exit_layer,
        quant_bits=args.quant_bits, lookahead_window=args.lookahead_window, lookahead_ngram=args.lookahead_ngram,
        lookahead_pool=args.lookahead_pool, acceptance=args.acceptance,
        options={**({"typical_epsilon": args.typical_epsilon, "typical_alpha": args.typical_epsilon**0.5}
                    if args.acceptance != "exact" else {}),
                 **({"draft_vocab": args.draft_vocab} if args.draft_vocab is not None else {}),
                 **({"draft_p_min": args.draft_p_min} if args.draft_p_min else {}),
                 **({"draft_lookup": args.draft_lookup} if args.draft_lookup is not None else {}),
                 **({"head_dtype": args.head_dtype} if args.head_dtype else {}),
                 **({"suffix_cache_requests": args.suffix_cache_requests} if args.suffix_cache_requests is not None else {}),
                 **({"suffix_min_score": args.suffix_min_score} if args.suffix_min_score is not None else {}),
                 **({"grammar_drafts": False} if args.no_grammar_drafts else {}),
                 **({"k_max": args.k_max} if args.k == "auto" else {})},
    )
    return params, spec


def load_llm(args, spec, prefix_cache: bool | None = False):
    """The verifier the flags name. prefix_cache: False for the commands that time or compare runs
    of the same prompts (a later run would read an earlier one's blocks); None (its default: on
    where a hit is exact) for `serve`, whose draft model then keeps its blocks too."""
    from forerun.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, speculative=spec, enable_prefix_caching=prefix_cache,
               kv_cache_dtype=args.kv_cache_dtype)


def in_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """`message` with the Python parameters it names (max_tokens, draft_model=, options['k_max'])
    written as the flags of `parser` that set them (--max-new-tokens, --draft-model, --k-max).
    >>> p = Parser(); _ = p.add_argument("--max-new-tokens"); _ = p.add_argument("--draft-model")
    >>> in_flags("max_tokens must be >= 1, got 0", p)
    '--max-new-tokens must be >= 1, got 0'
    >>> in_flags("method 'draft_model' needs draft_model= (a model folder)", p)
    "method 'draft_model' needs --draft-model (a model folder)"
    """
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    flags.update({name: flags[dest] for name, dest in PARAMETER_FLAGS.items() if dest in flags})
    names = sorted((n for n in flags if "_" in n or n == "temperature"), key=len, reverse=True)
    if not names:
        return message
    words = "|".join(re.escape(n) for n in names)
    # options['name'], name=, or the bare name (not inside quotes: "method 'draft_model'" stays)
    pattern = rf"options\[['\"]({words})['\"]\]|(?<![\w'\"-])({words})=?(?![\w'\"])"
    return re.sub(pattern, lambda m: flags[m.group(1) or m.group(2)], message)


@dataclass(frozen=True)
class CommandKit:
    """What a command module's `register(sub, kit)` gets to add its parsers the one way they are
    all added: the help formatter, the shared model / sampling / drafter options, the folder a
    command's files go to unless told. Each parser sets `handler` (args -> exit code), which
    `forerun`'s main calls."""

    fmt: type
    add_common: Callable
    runs_dir: str
