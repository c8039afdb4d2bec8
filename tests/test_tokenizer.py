"""forerun's Tokenizer on the embedded SmolLM2 folder against transformers' tokenizer for the same GGUF."""
import json
import shutil

import pytest

from forerun.errors import ForerunError, ModelLoadError
from forerun.streaming import TextStream
from forerun.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\nline five\n",
    "windows\r\nnewlines\r\n",
    "def add(a, b):\n    return a + b\n",
    "class A:\n\tdef f(self):\n\t\treturn {'k': [1, 2, 3]}\n",
    "if (x != y && z >= 0) { printf(\"%d\\n\", x); }",
    "1234567890",
    "pi = 3.14159265, e=2.718, -42, 1e-5, 0x1F, 1,000,000",
    "Version 2.0.1-rc3 released on 2024-06-30 at 12:45",
    "naïve café résumé façade Ångström",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "Ελληνικά και русский текст, עברית, العربية",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<|im_start|> spaced <|im_end|>",
    "<notatoken> <|not_special|>",
    "I'm sure you're right, they've said it's fine, we'll see, I'd go.",
    "ALL CAPS SHOUTING AND MiXeD CaSe",
    "https://example.com/path?query=1&other=two#frag",
    "email@example.org, @handle, #hashtag, $100, 50%",
    "\t\ttabs\tand  double  spaces",
    "",
    " ",
    "\n",
    "a" * 200,
    "math: ∑ᵢ xᵢ² ≤ ∞, √2 ≈ 1.414, α→β",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3? 日本語で答えて 😀"},
    ],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Write code."},
        {"role": "assistant", "content": "def f():\n    return 1"},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def ours(embedded_dir):
    return Tokenizer.from_pretrained(embedded_dir)


@pytest.fixture(scope="module")
def reference(embedded_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours, reference, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_digits_split_like_the_model_was_trained(ours, reference):
    # SmolLM2's own tokenizer.json and llama.cpp's "smollm" pre-tokenizer cut every numeral
    # (\p{N}) off on its own; transformers' GGUF loader does not. The two differ only where a merge
    # joins a numeral with what precedes it, e.g. a space before '½'. We follow the model.
    tokens = ours.get_vocab()
    assert ours.encode(" ½") == [tokens["Ġ"], tokens["Â½"]]
    assert reference.encode(" ½") != ours.encode(" ½")


def test_vocabulary_facts(ours, reference):
    assert ours.vocab_size == len(reference) == 49152
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == {reference.eos_token_id} == {2}
    assert ours.special_ids == set(reference.all_special_ids) | set(range(17))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, reference, messages):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_text_stream_matches_full_decode(ours):
    text = "Zoë says 你好 😀👍🏽 — naïve “quotes” ok"
    ids = ours.encode(text)
    for chunk in (1, 2, 3):
        pieces = []
        stream = TextStream(ours.decode, (), lambda i, t: pieces.append(t))
        for end in range(chunk, len(ids) + chunk, chunk):
            stream.update(0, ids[:end], finished=end >= len(ids))
        assert "".join(pieces) == ours.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_text_stream_never_emits_a_stop_string(ours):
    ids = ours.encode("alpha beta\n\ngamma")
    pieces = []
    stream = TextStream(ours.decode, ("\n\n",), lambda i, t: pieces.append(t))
    for end in range(1, len(ids) + 1):
        stream.update(0, ids[:end], finished=False)
    assert "".join(pieces) == "alpha beta"


def with_config(embedded_dir, folder, tokenizer_config: dict) -> Tokenizer:
    """The embedded tokenizer.json under a different tokenizer_config.json."""
    shutil.copy(embedded_dir / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return Tokenizer.from_pretrained(folder)


def test_template_helpers(embedded_dir, tmp_path):
    template = (
        "{{ messages[0]['content'] | tojson }}"
        "{% if messages | length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
    )
    tokenizer = with_config(embedded_dir, tmp_path, {"chat_template": template})
    assert tokenizer.apply_chat_template([{"role": "user", "content": "<é>"}]) == '"<é>"'
    with pytest.raises(ForerunError, match="only one message"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_bos_added_only_when_configured(ours, embedded_dir, tmp_path):
    with_bos = with_config(embedded_dir, tmp_path, {"bos_token": "<|im_start|>", "add_bos_token": True})
    assert with_bos.encode("hi") == [1, *ours.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == ours.encode("hi")


def test_errors(embedded_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ForerunError, match="no chat template"):
        with_config(embedded_dir, tmp_path, {}).apply_chat_template([{"role": "user", "content": "hi"}])
