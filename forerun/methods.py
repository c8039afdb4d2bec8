"""The speculative methods by name, each with one line on what drafts (`forerun methods`
prints them). SpeculativeConfig checks a method's name here, so naming one loads no drafter;
drafters/base.register adds a method registered at run time, and the drafters' own registry
is tested to hold exactly these names (tests/test_errors.py).

No imports: everything from config.py to the CLI may read it.
"""

NONE = "none"  # plain decoding: SpeculativeConfig(method=None), `--method none`

METHODS: dict[str, str] = {
    NONE: "plain decoding: the verifier alone, one token per forward (the baseline every speedup is against)",
    "ngram": "prompt lookup: continues the last n-gram's most recent match in the context (no model; --ngram-branches: a tree)",
    "draft_model": "a smaller model drafts (--draft-model; same tokenizer, or another one bridged by text)",
    "layer_skip": "the verifier with some layers skipped drafts, sharing its KV cache (skip set from `forerun tune-skip`)",
    "early_exit": "the verifier's first --exit-layer layers + its head draft (default: half the layers)",
    "quantized": "an int8 or int4 copy of the verifier drafts (--quant-bits)",
    "lookahead": "Jacobi iterations over a window + an n-gram pool from them, inside the verifier's own forward (no model)",
    "medusa": "trained heads on the verifier's last hidden state (--draft-model DIR from `forerun train`)",
    "eagle": "a trained one-layer head over hidden state + token embedding, drafting from its own guesses (--draft-model DIR)",
    "dflash": "a trained block head: one forward drafts all k tokens (--draft-model DIR)",
}


def lines() -> list[str]:
    """One line a method: its name, then what drafts."""
    width = max(map(len, METHODS))
    return [f"{name:<{width}}  {about}" for name, about in METHODS.items()]
