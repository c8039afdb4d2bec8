"""A tiny byte-level BPE tokenizer folder, built in the test (no files, no network): the 256 byte
tokens, a few merges (so a grammar meets multi-byte tokens), ChatML's special tokens with
<|im_end|> ending a turn, and a chat template with tools in Qwen2.5's <tool_call> form
(where a test passes one). Small enough for a tiny random model's vocabulary (~270 ids)."""
from __future__ import annotations

import json
from pathlib import Path

MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("n", "a"),
          ("na", "m"), ("nam", "e"), ("Ġ", "t"), ("a", "b")]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>"]  # as in Qwen2.5: whole tokens, but not special (decoded as text)


def tiny_tokenizer_dir(folder: Path, chat_template: str | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(ADDED)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
