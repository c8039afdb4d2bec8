"""Convert a llama, qwen2 or gemma3 GGUF file into a Hugging Face model folder, once.

The rest of forerun only reads HF-style folders (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json). A GGUF holds the same things in llama.cpp's shape: hyperparameters and the
tokenizer as metadata keys, weights under its own names, often quantised, q/k rows reordered for
its RoPE (llama) or norm weights stored as 1 + w (Gemma). This module undoes all of that,
dequantising every tensor to float32, so no other module ever has to know about GGUF.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from forerun.errors import ModelLoadError
from forerun.gguf.index import gguf_index, open_reader

SOURCE_FILE = "forerun_gguf.json"  # in a converted folder: the GGUF it came from

# llama.cpp name -> HF name. Per-layer names are `blk.{i}.{key}.weight` (and `.bias`, see _Arch.biased).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",  # the same GGUF name as llama's, another HF one
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_QKV = ("attn_q", "attn_k", "attn_v")

# tokenizer.ggml.token_type values (llama.cpp's enum).
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, weights: bool = True) -> Path:
    """Write `out_dir` as a HF folder holding the GGUF's model and tokenizer; return it.

    The folder appears whole or not at all (written beside it, then renamed), so a crash or a
    concurrent conversion never leaves a half-written model that looks complete. It records
    which GGUF it came from (dtype "gguf" computes with that file's blocks); with
    weights=False the float32 weights are left out, to be written by write_weights the first
    time a float precision needs them.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_reader(gguf_path)
    gguf_index(gguf_path, reader)  # what the native loads read instead of parsing the file again
    meta = _read_metadata(reader, gguf_path)
    arch = _architecture(meta, gguf_path)
    config = arch.config(meta, reader, gguf_path)
    tokenizer = build_tokenizer(meta, gguf_path)  # before the slow part: fail fast on a bad vocab
    tokenizer_config = _tokenizer_config(meta)
    generation_config = _generation_config(meta)
    tensors = _hf_state_dict(reader, arch, config, gguf_path, progress) if weights else None

    def write(folder: Path) -> None:
        from safetensors.numpy import save_file

        write_source(folder, gguf_path)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        if generation_config:
            (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        tokenizer.save(str(folder / "tokenizer.json"))
        if tensors is not None:
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    _write_atomically(out_dir, write)
    return out_dir


def write_weights(folder: Path, gguf_path: Path, progress: bool = True) -> None:
    """Add the float32 weights to a folder convert_gguf_to_hf wrote without them (written
    beside, then renamed into place: a crash never leaves a partial file)."""
    from safetensors.numpy import save_file

    reader = open_reader(gguf_path)
    meta = _read_metadata(reader, gguf_path)
    arch = _architecture(meta, gguf_path)
    config = arch.config(meta, reader, gguf_path)
    tensors = _hf_state_dict(reader, arch, config, gguf_path, progress)
    scratch = folder / f".model.safetensors.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file(tensors, str(scratch), metadata={"format": "pt"})
        os.chmod(scratch, 0o644)
        os.replace(scratch, folder / "model.safetensors")
    finally:
        scratch.unlink(missing_ok=True)


# --- reading -----------------------------------------------------------------------------------


def _read_metadata(reader, path: Path) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:
        raise ModelLoadError(f"{path}: unreadable GGUF metadata: {e}") from None


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _needer(meta: dict[str, Any], arch: str, path: Path) -> Callable[[str], Any]:
    """need(key) -> meta["{arch}.{key}"], or a ModelLoadError naming the missing key."""

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    return need


def _vocab_rows(reader, path: Path) -> int:
    """Rows of the embedding (ne = [hidden, vocab]): the vocabulary the model was built with."""
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    return int(embed.shape[1])


def llama_config(meta: dict[str, Any], reader, path: Path) -> dict[str, Any]:
    """The HF config.json for a llama GGUF; ModelLoadError for what the conversion cannot express."""
    shared = _llama_family_config(meta, reader, path, "llama")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shared, "attention_bias": False}


def qwen2_config(meta: dict[str, Any], reader, path: Path) -> dict[str, Any]:
    """The HF config.json for a qwen2 GGUF: llama's numbers, plus the q/k/v biases Qwen2 has.

    llama.cpp runs qwen2 with full attention in every layer, as Qwen2.5's own configs do
    (use_sliding_window false). Its files state rope.freq_base (1e6 for Qwen2.5); a file without
    it gets 10000, the default of both llama.cpp and transformers' Qwen2Config.
    """
    shared = _llama_family_config(meta, reader, path, "qwen2")
    extra = {"attention_bias": True, "use_sliding_window": False}
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **shared, **extra}


def _llama_family_config(meta: dict[str, Any], reader, path: Path, arch: str) -> dict[str, Any]:
    """The config.json fields llama and qwen2 GGUFs spell alike (under `{arch}.` keys)."""
    need = _needer(meta, arch, path)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    names = {t.name for t in reader.tensors}
    if scaling != "none" or "rope_freqs.weight" in names:
        raise ModelLoadError(f"{path}: RoPE scaling ({scaling}, rope_freqs) is not supported in GGUF conversion")
    hidden, n_head = int(need("embedding_length")), int(need("attention.head_count"))
    return {
        "vocab_size": _vocab_rows(reader, path),  # {arch}.vocab_size is optional
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // n_head)),
        "hidden_act": "silu",
        "mlp_bias": False,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def gemma3_config(meta: dict[str, Any], reader, path: Path) -> dict[str, Any]:
    """The HF config.json (model_type gemma3_text) for a gemma3 GGUF.

    llama.cpp keeps some Gemma 3 constants in code rather than in the file; absent keys take
    them: every 6th layer global, the rest sliding; local RoPE base 10000; attention scale
    head_dim**-0.5, except the 27B (62 layers), which scales by (hidden / heads)**-0.5.
    """
    need = _needer(meta, "gemma3", path)
    hidden, n_head, layers = int(need("embedding_length")), int(need("attention.head_count")), int(need("block_count"))
    head_dim = int(meta.get("gemma3.attention.key_length", 256))
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding
        layer_types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(layers)]
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{path}: Gemma 3 RoPE scaling {scaling!r} is not supported (none, linear)")
    rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))} if scaling == "linear" else None
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": _vocab_rows(reader, path),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("gemma3.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": _f32(meta.get("gemma3.rope.freq_base_swa", 10_000.0)),
        "rope_scaling": rope_scaling,
        "sliding_window": int(need("attention.sliding_window")),
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // n_head if layers == 62 else head_dim,
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


@dataclass(frozen=True)
class _Arch:
    """What converting one GGUF architecture takes."""

    config: Callable[[dict[str, Any], Any, Path], dict[str, Any]]  # (meta, reader, path) -> config.json
    layer_names: dict[str, str]  # llama.cpp per-layer name -> HF name
    rope_rows_permuted: bool  # llama.cpp interleaved each q/k head's rows for its RoPE (llama only)
    norm_shift: float  # llama.cpp stores Gemma norm weights as 1 + w: subtract this to get HF's w
    biased: tuple[str, ...] = ()  # per-layer names that also carry a `.bias` (qwen2's q/k/v)


_ARCHITECTURES = {
    "llama": _Arch(llama_config, _LAYER_NAMES, rope_rows_permuted=True, norm_shift=0.0),
    # llama.cpp's converter permutes q/k for llama only; qwen2 rows are already in HF's order.
    "qwen2": _Arch(qwen2_config, _LAYER_NAMES, rope_rows_permuted=False, norm_shift=0.0, biased=_QKV),
    "gemma3": _Arch(gemma3_config, _GEMMA3_LAYER_NAMES, rope_rows_permuted=False, norm_shift=1.0),
}


def _architecture(meta: dict[str, Any], path: Path) -> _Arch:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        known = sorted(_ARCHITECTURES)
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (forerun converts {known})")
    return _ARCHITECTURES[arch]


# --- weights -----------------------------------------------------------------------------------


def hf_tensor_name(
    gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES, biased: tuple[str, ...] = ()
) -> str | None:
    """HF name for a llama.cpp tensor name, or None if forerun does not know it.

    A `.bias` is known only for the layer names in `biased`: a bias the architecture has no
    place for (a q bias in a llama file) must be refused, not silently dropped.
    >>> hf_tensor_name("blk.3.attn_k.weight")
    'model.layers.3.self_attn.k_proj.weight'
    >>> hf_tensor_name("blk.0.ffn_norm.weight", _GEMMA3_LAYER_NAMES)
    'model.layers.0.pre_feedforward_layernorm.weight'
    >>> hf_tensor_name("blk.5.attn_q.bias", biased=_QKV), hf_tensor_name("blk.5.attn_q.bias")
    ('model.layers.5.self_attn.q_proj.bias', None)
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in layer_names and (match[3] == "weight" or match[2] in biased):
        return f"model.layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"
    return None


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Put a q/k projection's rows back in HF's rotate-half order.

    HF rotates dimension j of a head together with j + head_dim/2; llama.cpp rotates 2j with 2j+1.
    So llama.cpp's converter interleaves each head's two halves. Reading the rows of each head in
    pairs and de-interleaving them restores the HF order (head_dim 4: x0 y0 x1 y1 -> x0 x1 y0 y1).

    >>> unpermute_rope_rows(np.array([[0], [10], [1], [11]]), n_heads=1)[:, 0].tolist()
    [0, 1, 10, 11]
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    pairs = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])  # (heads, half, 2, in)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor, path: Path) -> np.ndarray:
    return dequantize_bytes(tensor.data, int(tensor.tensor_type), tuple(int(n) for n in tensor.shape), tensor.name, path)


def dequantize_bytes(data: np.ndarray, qtype: int, dims: tuple[int, ...], name: str, path: Path) -> np.ndarray:
    """A tensor's data (its raw bytes, or the reader's typed view) of ggml type `qtype` and GGUF
    dims (fastest-first) -> float32 values, shaped slowest-first."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        kind = GGMLQuantizationType(qtype)
        values = dequantize(data, kind)
    except Exception as e:  # an unknown or unimplemented quant type, or data cut short
        known = GGMLQuantizationType._value2member_map_.get(qtype)
        raise ModelLoadError(f"{path}: cannot dequantise {name} ({known.name if known else f'ggml type {qtype}'}): {e}") from None
    expected = tuple(reversed(dims))
    if values.size != int(np.prod(expected)):
        raise ModelLoadError(f"{path}: tensor {name} holds {values.size} values, expected {expected}")
    return np.ascontiguousarray(values.reshape(expected), dtype=np.float32)


def _hf_state_dict(reader, arch: _Arch, config: dict[str, Any], path: Path, progress: bool) -> dict[str, np.ndarray]:
    from tqdm import tqdm

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state = {}
    for tensor in tqdm(reader.tensors, desc="GGUF -> safetensors", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name, arch.layer_names, arch.biased)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} for a {config['model_type']} model")
        values = _dequantize(tensor, path)
        kind = tensor.name.split(".")[-2]
        if arch.rope_rows_permuted and kind in heads:
            values = unpermute_rope_rows(values, heads[kind])
        if arch.norm_shift and kind.endswith("norm"):
            values = values - np.float32(arch.norm_shift)
        state[name] = values
    _check_complete(state, arch, config, path)
    return state


def _check_complete(state: dict[str, np.ndarray], arch: _Arch, config: dict[str, Any], path: Path) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{hf}.weight" for hf in arch.layer_names.values()}
        expected |= {f"model.layers.{i}.{arch.layer_names[kind]}.bias" for kind in arch.biased}
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(f"{path}: GGUF lacks {len(missing)} {config['model_type']} tensor(s), e.g. {missing[0]}")


# --- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer(meta: dict[str, Any], path: Path):
    """A `tokenizers.Tokenizer` equal to the one the GGUF describes: byte-level BPE ("gpt2") or
    Gemma's SentencePiece BPE ("llama" in a gemma3 file).

    Control tokens (e.g. <|im_start|>, <start_of_turn>) become special added tokens and
    user-defined ones plain added tokens, so text containing them maps to one id instead of being
    split. A user-defined token the model spells differently (Gemma's runs of spaces, which its
    BPE sees as runs of "▁") is left to the model. BOS is not added here; forerun's Tokenizer
    adds it when tokenizer_config says add_bos_token.
    """
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    if kind not in _TOKENIZER_MODELS:
        raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported (known: {sorted(_TOKENIZER_MODELS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    tokenizer, pieces = _TOKENIZER_MODELS[kind](meta, tokens, path)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, piece, k in zip(tokens, pieces, types) if k == _USER_DEFINED and t == piece]
    )
    return tokenizer


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], path: Path):
    """GPT-2-style BPE: the file's merges, its pre-tokenizer split; tokens are spelled as stored."""
    from tokenizers import Tokenizer, decoders, models

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    try:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # a merge naming an unknown token, or one without a space
        raise ModelLoadError(f"{path}: inconsistent tokenizer merges in GGUF metadata: {e}") from None
    normalizer, tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, tokens


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], path: Path):
    """Gemma's SentencePiece BPE: spaces become "▁" (no prefix space), no pre-tokenizer (so the
    text between added tokens is one BPE word), unknown characters fall back to <0xNN> bytes.

    Only checked for gemma3 files: other SentencePiece models (Llama 2...) add a prefix space and
    rank merges by score, which is not implemented; refuse rather than tokenise differently.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ModelLoadError(f"{path}: SentencePiece ('llama') tokenizers convert for gemma3 files only, not {arch!r}")
    # llama.cpp stores Gemma's runs of spaces as real spaces; the BPE only ever sees "▁".
    pieces = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab, merges=sentencepiece_merges(pieces, vocab), unk_token=None if unk is None else tokens[unk],
        fuse_unk=True, byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer, pieces


def sentencepiece_merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (a GGUF lists none), best first.

    SentencePiece BPE repeatedly joins the adjacent pair whose union is the best-ranked piece.
    Every split of a piece into two pieces is a merge; merges rank by their result's index in
    the vocabulary, then by the longer left part. That is the order transformers' GGUF loader
    uses for Gemma (not the file's scores), and tests/test_gemma3.py checks ids against it.
    >>> sentencepiece_merges(["a", "b", "c", "ab", "abc"], {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4})
    [('a', 'b'), ('ab', 'c')]
    """
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


_TOKENIZER_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}  # tokenizer.ggml.model -> builder


# Qwen2's word split (transformers' Qwen2Tokenizer, llama.cpp's "qwen2"): GPT-2's, except that
# contractions match in any case ("I'LL" -> "'LL"), a letter run takes one leading non-letter
# ("(x" stays whole) and every digit stands alone.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, path: Path):
    """(normalizer or None, pre-tokenizer): how text is cut into words before BPE, from
    `tokenizer.ggml.pre`.

    "smollm" is GPT-2's split plus every digit on its own, as SmolLM's own tokenizer.json has it
    (its vocabulary has no multi-digit tokens, so the digit split never changes the ids, but it
    keeps us honest for text the merges would otherwise join). "qwen2" is Qwen2's tokenizer.json:
    NFC first, then its split regex, then the byte mapping alone. Other split regexes
    (llama-bpe...) are not implemented: refuse rather than tokenise differently from training.
    """
    from tokenizers import Regex, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return None, byte_level
    if pre == "smollm":
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, bytes_only])
    raise ModelLoadError(f"{path}: pre-tokenizer {pre!r} is not supported (known: default, gpt2, smollm, qwen2)")


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


# general.architecture -> tokens that end a chat turn besides the file's eos (HF's folders list
# both in generation_config.json: Gemma's [<eos>, <end_of_turn>], Qwen2.5-Instruct's
# [<|im_end|>, <|endoftext|>]).
_TURN_ENDS = {"gemma3": ("<end_of_turn>",), "qwen2": ("<|im_end|>", "<|endoftext|>")}


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json stopping on every turn end: a GGUF names one eos, but a chat turn
    may end with another token (Gemma's <end_of_turn>; Qwen's <|im_end|> or, for a base
    model, <|endoftext|>). Empty (no file) when there is nothing beyond the eos to add.

    >>> _generation_config({"general.architecture": "qwen2", "tokenizer.ggml.eos_token_id": 2,
    ...     "tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]})
    {'bos_token_id': None, 'eos_token_id': [2, 0]}
    """
    tokens = meta["tokenizer.ggml.tokens"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ends = [eos] if eos is not None else []
    for name in _TURN_ENDS.get(meta.get("general.architecture"), ()):
        if name in tokens and tokens.index(name) not in ends:
            ends.append(tokens.index(name))
    if len(ends) < 2:
        return {}
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": ends}


# --- writing -----------------------------------------------------------------------------------


def _write_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write` into a scratch folder beside `out_dir`, then swap it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(scratch)
        for item in [scratch, *scratch.iterdir()]:  # mkdtemp and safetensors make them private
            os.chmod(item, 0o755 if item.is_dir() else 0o644)
        try:
            os.rename(scratch, out_dir)
        except OSError:
            if not out_dir.exists():
                raise
            # rename() cannot replace a non-empty folder (an older conversion, or a concurrent one
            # that finished first): move it aside, put ours in place, then delete it.
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, old)
            os.rename(scratch, out_dir)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # a no-op once renamed


def write_source(folder: Path, gguf_path: Path) -> None:
    """Record in a converted folder which GGUF it came from (dtype gguf reads its blocks: linears/gguf.py)."""
    (folder / SOURCE_FILE).write_text(json.dumps({"path": str(Path(gguf_path).resolve())}) + "\n")


def source_of(folder: Path) -> Path | None:
    """The GGUF a converted folder came from, or None (a HF folder, or a folder converted before
    forerun recorded it)."""
    try:
        path = Path(json.loads((folder / SOURCE_FILE).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None
