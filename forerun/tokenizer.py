"""Text <-> token ids for a HF-style model folder, without transformers.

`Tokenizer` wraps a `tokenizers.Tokenizer` (tokenizer.json) with the few facts generation needs
from tokenizer_config.json and config.json: which ids end a turn, whether BOS is prepended, and
the chat template, rendered the way Hugging Face renders it so prompts match the reference.
`StreamDecoder` turns ids into text as they arrive, never emitting half a UTF-8 character.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from forerun.errors import ForerunError, ModelLoadError

# What a byte-level decoder yields for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, backend, tokenizer_config: dict[str, Any], model_config: dict[str, Any]):
        """`backend` is a `tokenizers.Tokenizer`; the two dicts are the folder's JSON configs."""
        self._backend = backend
        self._config = tokenizer_config
        self._model_config = model_config
        self._template = None  # compiled on first use
        self._add_bos = self._decide_add_bos()

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Read tokenizer.json (required), tokenizer_config.json, config.json and
        generation_config.json (optional) from a model folder."""
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path} is not a valid tokenizer file: {e}") from None
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"  # newer HF folders keep the template apart
        if "chat_template" not in tokenizer_config and template_file.is_file():
            tokenizer_config["chat_template"] = template_file.read_text()
        model_config = _read_json(folder / "config.json")
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        model_config["eos_token_id"] = _as_list(model_config.get("eos_token_id")) + _as_list(generation_eos)
        return cls(backend, tokenizer_config, model_config)

    # --- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def token_id(self, token: str | dict | None) -> int | None:
        """Id of a token string (or HF's {"content": ...} form); None if absent."""
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.token_id(self._config.get("bos_token"))
        return bos if bos is not None else self._model_config.get("bos_token_id")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: config.json's and generation_config.json's
        eos_token_id (an int or a list) plus the tokenizer's eos_token."""
        ids = set(_as_list(self._model_config.get("eos_token_id")))
        eos = self.token_id(self._config.get("eos_token"))
        return ids | ({eos} if eos is not None else set())

    @property
    def special_ids(self) -> set[int]:
        """Ids of the special added tokens (<|im_start|>, <|endoftext|>, ...)."""
        decoder = self._backend.get_added_tokens_decoder()
        return {index for index, token in decoder.items() if token.special}

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text like "<|im_start|>" maps to its single id.

        BOS is prepended only when the folder says so (tokenizer_config's add_bos_token), even if
        the text already starts with it, as Hugging Face does.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (the `tokenizers` library's serialisation): what a
        grammar engine builds its own token table from (forerun/structured/grammar.py)."""
        return self._backend.to_str()

    def token_texts(self) -> list[str | None]:
        """The text each id stands for on its own; None for special tokens and for pieces of
        a multi-byte character (they decode to U+FFFD). Used to match two vocabularies."""
        texts = self._backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        special = self.special_ids
        return [None if (i in special or not t or _REPLACEMENT in t) else t for i, t in enumerate(texts)]

    def _decide_add_bos(self) -> bool:
        """tokenizer_config's add_bos_token; if it is silent, whether tokenizer.json's
        post-processor prepends BOS (Llama-3 style folders say it only there)."""
        if "add_bos_token" in self._config:
            return bool(self._config["add_bos_token"])
        bos = self.bos_token_id
        return bos is not None and self._backend.encode("", add_special_tokens=True).ids[:1] == [bos]

    # --- chat -------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        template = self._config.get("chat_template")
        if isinstance(template, list):  # HF's named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return template

    def info(self) -> dict[str, Any]:
        """The special tokens' text and the chat template (what vLLM's /tokenizer_info serves)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {**{name: _token_text(self._config.get(name)) for name in names}, "chat_template": self.chat_template,
                "add_bos_token": self._add_bos}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]) and `tools`, as HF renders it."""
        if self._template is None:
            if not self.chat_template:
                raise ForerunError("this model has no chat template; pass a plain prompt instead of messages")
            self._template = _compile_template(self.chat_template)
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        special = {name: _token_text(self._config.get(name)) for name in names}
        return self._template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **special
        )


def _compile_template(source: str):
    """A jinja2 template in HF's environment: sandboxed, trim/lstrip blocks, loop controls,
    a JSON `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, and the
    `{% generation %}` tag (training-mask marker; it renders its body unchanged here)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise ForerunError(f"chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja's own tojson HTML-escapes <, >, & and ', which would change the prompt text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template is not valid jinja: {e}") from None


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON config as a dict; {} if the file is absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
