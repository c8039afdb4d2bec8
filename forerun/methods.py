"""The speculative methods by name: what kind of drafter each is, one line on what drafts,
and which settings it reads (`forerun methods` prints them). SpeculativeConfig checks a
method's name here, so naming one loads no drafter; drafters/base.register adds a method
registered at run time, and the drafters' own registry is tested to hold exactly these
names (tests/test_errors.py).

No imports but the standard library: everything from config.py to the CLI may read it.

    >>> METHODS["ngram"].kind, METHODS["ngram"].fields
    ('model-free', ('ngram_min', 'ngram_max', 'ngram_branches'))
"""
from __future__ import annotations

from dataclasses import dataclass

NONE = "none"  # plain decoding: SpeculativeConfig(method=None), `--method none`

# The kinds of drafter, cheapest first: what a draft costs.
KINDS = {
    "plain": "no drafter",
    "model-free": "drafts from text already seen: no model forward",
    "draft model": "a separate, smaller model",
    "self-draft": "the verifier itself, cut down (fewer layers, fewer bits)",
    "trained head": "small heads trained on the verifier's hidden states (`forerun train`)",
    "registered": "a drafter registered at run time (drafters/base.register)",
}
HEAD_OPTIONS = ("draft_vocab", "draft_vocab_context", "head_dtype")  # a reduced LM head (drafters/draft_vocab.py)
TREE_OPTIONS = ("tree_nodes", "tree_beam")  # a trained drafter's tree (drafters/tree_select.py)


@dataclass(frozen=True)
class Method:
    kind: str  # a key of KINDS
    about: str  # one line: what drafts
    fields: tuple[str, ...] = ()  # SpeculativeConfig fields it reads beyond k and acceptance
    options: tuple[str, ...] = ()  # SpeculativeConfig.options keys it reads


METHODS: dict[str, Method] = {
    NONE: Method("plain", "plain decoding: the verifier alone, one token per forward (the baseline every speedup is against)"),
    "ngram": Method("model-free", "prompt lookup: continues the last n-gram's most recent match in the context "
                    "(--ngram-branches: a tree)", ("ngram_min", "ngram_max", "ngram_branches")),
    "suffix": Method("model-free", "suffix decoding: trees of what followed the tail in this request and in the tenant's "
                     "earlier outputs (--draft-model: a hybrid, the model drafts where no tree is confident)",
                     ("draft_model", "draft_dtype"), ("suffix_cache_requests", "suffix_max_match", "suffix_factor",
                                                      "suffix_min_prob", "suffix_min_score")),
    "draft_model": Method("draft model", "a smaller model drafts (--draft-model; same tokenizer, or another one bridged "
                          "by text)", ("draft_model", "draft_dtype", "tree_width", "ngram_max"),
                          ("draft_lookup", "draft_p_min", *HEAD_OPTIONS)),
    "layer_skip": Method("self-draft", "the verifier with some layers skipped drafts, sharing its KV cache (skip set "
                         "from `forerun tune-skip`)", ("skip_layers",)),
    "early_exit": Method("self-draft", "the verifier's first --exit-layer layers + its head draft (default: half the "
                         "layers)", ("exit_layer",)),
    "quantized": Method("self-draft", "an int8 or int4 copy of the verifier drafts (--quant-bits)",
                        ("quant_bits", "tree_width"), ("draft_p_min",)),
    "lookahead": Method("model-free", "Jacobi iterations over a window + an n-gram pool from them, inside the "
                        "verifier's own forward (no model)", ("lookahead_window", "lookahead_ngram", "lookahead_pool")),
    "medusa": Method("trained head", "trained heads on the verifier's last hidden state (--draft-model DIR from "
                     "`forerun train`)", ("draft_model", "tree_width"), (*TREE_OPTIONS, *HEAD_OPTIONS)),
    "eagle": Method("trained head", "a trained one-layer head over hidden state + token embedding, drafting from its "
                    "own guesses (--draft-model DIR)", ("draft_model", "tree_width"), (*TREE_OPTIONS, *HEAD_OPTIONS)),
    "dflash": Method("trained head", "a trained block head: one forward drafts all k tokens (--draft-model DIR)",
                     ("draft_model", "tree_width"), (*TREE_OPTIONS, *HEAD_OPTIONS)),
}
# Options any method reads (config.py): k under "auto", the lossy acceptance's parameters.
# grammar_drafts: a structured output's forced tokens lead each draft (default true; false to measure without);
# grammar_continue: a token-only drafter (suffix, n-gram) drafts on after them (default true; false to measure without).
COMMON_OPTIONS = ("k_max", "verify_cost", "typical_epsilon", "typical_alpha", "grammar_drafts", "grammar_continue")


def lines() -> list[str]:
    """One line a method: its name, its kind, what drafts, then the settings it reads."""
    width, kinds = max(map(len, METHODS)), max(map(len, KINDS))
    out = []
    for name, m in METHODS.items():
        reads = ", ".join([*m.fields, *(f"options[{o!r}]" for o in m.options)])
        out.append(f"{name:<{width}}  {m.kind:<{kinds}}  {m.about}" + (f" [reads {reads}]" if reads else ""))
    return out
