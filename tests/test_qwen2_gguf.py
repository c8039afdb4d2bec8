"""qwen2 GGUF -> HF folder, checked against transformers' own GGUF loader on the same file.

Tiny random qwen2 files (q/k/v biases; tied and untied head) written here in llama.cpp's layout
must convert to the weights transformers loads, and forerun must compute its logits. The tiny
vocabulary is a byte-level BPE learned on text that was never split into words, so its merges
cross spaces, digits and punctuation: only Qwen2's split regex gives transformers' ids. A real
Qwen2.5-Coder GGUF, where one is cached, checks the tokenizer at full size.

forerun's qwen2 tokenizer normalises to NFC first, as Qwen2's own tokenizer.json does;
transformers' GGUF loader leaves that step out. The two differ on non-NFC text only (see
test_nfc_is_the_one_step_transformers_gguf_loader_skips); the shared texts are NFC.
"""
import json
import os
import re
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import transformers

from forerun.embedded import CACHE_ENV, cache_dir
from forerun.errors import ModelLoadError
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from forerun.gguf.convert import (
    _pre_tokenizer, _read_metadata, _tokenizer_config, build_tokenizer, convert_gguf_to_hf,
)
from forerun.tokenizer import Tokenizer
from tests.test_gguf_convert import tiny_hf_weights, write_tiny_gguf

TEXTS = [
    "Hello world", " leading space", "  two leading spaces", "trailing   ", "tabs\tand\t\ttabs",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "    if x:\n        y = [i**2 for i in range(10)]  # squares\n",
    "numbers 12345 3.14159 -42 1,000,000 x2 v1.2.3",
    "日本語のテキストと中文，混合 text", "emoji 🤖🚀 and 👩‍👩‍👧 family",
    "I'LL go, you'll see; we'Re sure it's DON'T", "line\nbreaks\n\n\nmany\r\nwindows\r\n",
    "Ünïcödé façade naïve – “quotes” «guillemets»",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>{"name": "f"}</tool_call><|endoftext|>', "zero\u200bwidth and \x00 control",
    "https://example.com/a?b=c#d (x) [y] {z}", "word  word   word    word        ",
]
PROMPT = TEXTS[13] + TEXTS[5]  # a chat turn asking for code
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TURN_END, END_OF_TEXT = SPECIALS.index("<|im_end|>"), SPECIALS.index("<|endoftext|>")


def learned_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE learned on TEXTS without any word split; the special
    tokens come first (ids 0..4) and are kept out of the training text."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    specials = re.compile("|".join(map(re.escape, SPECIALS)))
    backend.train_from_iterator([specials.sub(" ", text) for text in TEXTS] * 3, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert tokens[: len(SPECIALS)] == SPECIALS
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


@pytest.fixture(scope="module")
def vocab():
    return learned_vocab()


@pytest.fixture(scope="module", params=["untied", "tied"])
def qwen2_gguf(request, vocab, tmp_path_factory):
    """(gguf path, converted folder, original HF weights) for a tiny random qwen2."""
    root = tmp_path_factory.mktemp(request.param)
    tokens, merges = vocab
    weights = tiny_hf_weights(len(tokens), qkv_bias=True, tied=request.param == "tied")
    path = root / "tiny-qwen2.gguf"
    write_tiny_gguf(path, weights, tokens, merges, arch="qwen2")
    return path, convert_gguf_to_hf(path, root / "hf", progress=False), weights


def test_weights_match_originals_and_transformers(qwen2_gguf):
    path, folder, weights = qwen2_gguf
    ours = load_file(folder / "model.safetensors")
    assert ours.keys() == weights.keys()
    for name, original in weights.items():
        exact = original.ndim == 1 or name.endswith(("q_proj.weight", "k_proj.weight"))  # F32 in the file
        expected = original if exact else original.astype("float16").astype("float32")
        assert torch.equal(ours[name], torch.from_numpy(expected)), name
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    theirs = reference.state_dict()
    assert theirs.keys() == ours.keys() | {"lm_head.weight"}  # transformers lists a tied head too
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def test_config_matches_transformers(qwen2_gguf):
    path, folder, weights = qwen2_gguf
    ours = json.loads((folder / "config.json").read_text())
    reference = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours["model_type"] == reference.model_type == "qwen2" and ours["architectures"] == ["Qwen2ForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "use_sliding_window"):
        assert ours[key] == getattr(reference, key), key
    assert ours["rope_theta"] == reference.rope_parameters["rope_theta"] == 1e6
    assert ours["attention_bias"] is True and ours["tie_word_embeddings"] is ("lm_head.weight" not in weights)


def test_logits_match_transformers(qwen2_gguf, tmp_path, monkeypatch):
    """forerun's LLM on the .gguf itself (converted into a scratch cache) vs transformers on the
    same file, both in float64; transformers computes RoPE angles in float32, hence 1e-6."""
    path, _, _ = qwen2_gguf
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    llm = LLM(model=str(path), dtype="float64", progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    ids = llm.tokenizer.encode(PROMPT)
    assert 20 < len(ids) < 64
    with torch.no_grad():
        expected = reference.double().eval()(torch.tensor([ids])).logits[0]
    model = llm.model
    got = model(chain_batch([ids], [0], [0], model.device), model.new_cache(1, len(ids))).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_tokenizers(vocab, tmp_path_factory):
    """(forerun's Tokenizer from the converted folder, transformers' from the GGUF, folder)."""
    root = tmp_path_factory.mktemp("tok")
    path = root / "tok.gguf"
    write_tiny_gguf(path, tiny_hf_weights(len(vocab[0]), qkv_bias=True), *vocab, arch="qwen2")
    folder = convert_gguf_to_hf(path, root / "hf", progress=False)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Tokenizer.from_pretrained(folder), reference, folder


def test_tokenizer_ids_match_transformers(tiny_tokenizers):
    ours, reference, _ = tiny_tokenizers
    for text in TEXTS:
        assert unicodedata.is_normalized("NFC", text), text
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_vocab_tells_split_regexes_apart(tiny_tokenizers):
    """The comparison has teeth: with GPT-2's split the same vocabulary gives other ids
    in a good share of the texts (digit runs, "'LL", newline runs are cut differently)."""
    from tokenizers import Tokenizer as Backend

    ours, _, folder = tiny_tokenizers
    gpt2 = Backend.from_file(str(folder / "tokenizer.json"))
    gpt2.pre_tokenizer = _pre_tokenizer("gpt2", folder)[1]
    assert gpt2.encode("I'LL 12").tokens == ["I", "'", "L", "L", "Ġ", "12"]
    assert ours.encode("I'LL 12") == [gpt2.token_to_id(t) for t in ["I", "'L", "L", "Ġ", "1", "2"]]
    differing = [text for text in TEXTS if gpt2.encode(text).ids != ours.encode(text)]
    assert len(differing) >= len(TEXTS) // 3, differing


def test_tokenizer_pipeline_is_qwen2s(tiny_tokenizers):
    """Qwen2's tokenizer.json pipeline; split and decoder exactly as transformers builds them."""
    ours, reference, folder = tiny_tokenizers
    saved = json.loads((folder / "tokenizer.json").read_text())
    theirs = json.loads(reference.backend_tokenizer.to_str())
    assert saved["normalizer"] == {"type": "NFC"}
    assert saved["pre_tokenizer"] == theirs["pre_tokenizer"] and saved["decoder"] == theirs["decoder"]
    special = {t["content"] for t in saved["added_tokens"] if t["special"]}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert ours.special_ids == {0, 1, 2} and ours.encode("<tool_call>") == [3]  # user-defined: whole, not special


def test_nfc_is_the_one_step_transformers_gguf_loader_skips(tiny_tokenizers):
    ours, reference, _ = tiny_tokenizers
    text = "cafe\u0301 Cafe\u0301s n\u0303"  # decomposed: e + combining acute
    assert ours.encode(text) == reference.encode(unicodedata.normalize("NFC", text)) != reference.encode(text)


def test_turn_ends_at_im_end_and_endoftext(tiny_tokenizers):
    """A Qwen2.5 instruct turn ends with <|im_end|>; a base model's text with <|endoftext|>."""
    ours, _, folder = tiny_tokenizers
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [TURN_END, END_OF_TEXT]  # file eos first, like HF's [151645, 151643]
    assert ours.eos_token_ids == {TURN_END, END_OF_TEXT}
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_other_split_regexes_are_still_refused():
    with pytest.raises(ModelLoadError, match="x.gguf: pre-tokenizer 'llama-bpe' is not supported"):
        _pre_tokenizer("llama-bpe", Path("x.gguf"))


# --- a real Qwen2.5-Coder GGUF, where one is cached ---------------------------------------------

REAL_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _real_gguf() -> Path | None:
    """$FORERUN_QWEN_GGUF, else the forerun cache's gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf."""
    if os.environ.get("FORERUN_QWEN_GGUF"):
        return Path(os.environ["FORERUN_QWEN_GGUF"]).expanduser()
    cached = cache_dir() / "gguf" / REAL_NAME
    return cached if cached.is_file() else None


@pytest.fixture(scope="module")
def real_tokenizers():
    """(forerun's Tokenizer from the GGUF's metadata alone, transformers' from the GGUF); ~20 s."""
    from forerun.gguf.convert import _generation_config
    from forerun.gguf.index import open_reader

    path = _real_gguf()
    if path is None:
        pytest.skip(f"no Qwen2.5-Coder GGUF: set FORERUN_QWEN_GGUF or cache {cache_dir() / 'gguf' / REAL_NAME}")
    meta = _read_metadata(open_reader(path), path)
    assert meta["general.architecture"] == "qwen2" and meta["tokenizer.ggml.pre"] == "qwen2"
    model_config = {"eos_token_id": _generation_config(meta).get("eos_token_id")}
    ours = Tokenizer(build_tokenizer(meta, path), _tokenizer_config(meta), model_config)
    return ours, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_real_tokenizer_ids_match_transformers(real_tokenizers):
    ours, reference = real_tokenizers
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
    assert ours.encode("<|im_start|>user\n12345<|im_end|>")[:5] == [151644, 872, 198, 16, 17]


def test_real_chat_turn_and_template(real_tokenizers):
    ours, reference = real_tokenizers
    im_end, end_of_text = (reference.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert (im_end, end_of_text) == (151645, 151643) and ours.eos_token_ids == {im_end, end_of_text}
    messages = [{"role": "user", "content": "Write quicksort in Python."}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert expected.endswith("<|im_end|>\n<|im_start|>assistant\n")
