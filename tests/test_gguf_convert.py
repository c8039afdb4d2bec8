"""GGUF -> HF folder conversion, checked against transformers' own GGUF loader.

A tiny random llama GGUF, written here in llama.cpp's layout (q/k rows interleaved for its RoPE),
must convert to exactly the weights transformers loads from the same file and to the weights we
started from; the embedded SmolLM2 folder must agree with transformers on config and weights.
"""
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from forerun.errors import ModelLoadError
from forerun.gguf.convert import convert_gguf_to_hf, unpermute_rope_rows

TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, context=64)


def gpt2_byte_chars() -> list[str]:
    """GPT-2's spelling of bytes 0..255 as printable characters (byte-level BPE's alphabet)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def to_llama_cpp_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two halves interleaved (x0 x1 y0 y1 -> x0 y0 x1 y1)."""
    head_dim = weight.shape[0] // n_heads
    halves = weight.reshape(n_heads, 2, head_dim // 2, weight.shape[1])  # (heads, 2, half, in)
    return halves.swapaxes(1, 2).reshape(weight.shape)


def tiny_hf_weights(vocab: int, seed: int = 0, qkv_bias: bool = False, tied: bool = False) -> dict[str, np.ndarray]:
    """Random weights in HF names and layout; q/k/v/o and embeddings untied from the head unless
    `tied` (no lm_head); q/k/v biases (Qwen2's) with `qkv_bias`."""
    rng = np.random.default_rng(seed)
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (TINY["heads"] * hd, h),
            p + "self_attn.k_proj.weight": (TINY["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": (TINY["kv_heads"] * hd, h),
            p + "self_attn.o_proj.weight": (h, TINY["heads"] * hd),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if qkv_bias:
            shapes |= {p + f"self_attn.{x}_proj.bias": (n * hd,) for x, n in
                       (("q", TINY["heads"]), ("k", TINY["kv_heads"]), ("v", TINY["kv_heads"]))}
    return {name: (rng.standard_normal(shape) * 0.2).astype(np.float32) for name, shape in shapes.items()}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)  # suffix: weight or bias
    return f"blk.{layer}.{parts[module]}.{suffix}"


def token_type(token: str) -> int:
    """llama.cpp's token_type for the tiny vocabularies: <|...|> control (3), <tool_call> and
    </tool_call> user-defined (4, as in Qwen2.5's files), the rest normal (1)."""
    if token.startswith("<|"):
        return 3
    return 4 if token in ("<tool_call>", "</tool_call>") else 1


def write_tiny_gguf(path, weights: dict[str, np.ndarray], tokens, merges, arch: str = "llama") -> None:
    """A GGUF as llama.cpp's converter would write it: 2-D weights as F16 except q/k (F32, so
    they can be compared exactly with the originals), norms and biases F32. A llama file has
    q/k rows permuted for llama.cpp's RoPE; a qwen2 file keeps HF's rows (llama.cpp permutes
    llama only), Qwen's pre-tokenizer and its RoPE base of 1e6."""
    import gguf

    qwen2 = arch == "qwen2"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1e6 if qwen2 else 10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if qwen2 else "default")
    writer.add_token_list(tokens)
    writer.add_token_types([token_type(t) for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, value in weights.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = to_llama_cpp_rows(value, TINY["heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = to_llama_cpp_rows(value, TINY["kv_heads"])
        elif value.ndim == 2 and not name.endswith(("q_proj.weight", "k_proj.weight")):
            value = value.astype(np.float16)
        writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, converted folder, original HF weights) for a tiny random llama."""
    root = tmp_path_factory.mktemp("tiny")
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *gpt2_byte_chars(), "Ġt", "he", "Ġthe"]
    weights = tiny_hf_weights(len(tokens))
    path = root / "tiny.gguf"
    write_tiny_gguf(path, weights, tokens, ["Ġ t", "h e", "Ġt he"])
    return path, convert_gguf_to_hf(path, root / "hf", progress=False), weights


def test_unpermute_inverts_llama_cpp_order():
    weight = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rope_rows(to_llama_cpp_rows(weight, 2), 2), weight)


def test_tiny_weights_round_trip(tiny):
    _, folder, weights = tiny
    ours = load_file(folder / "model.safetensors")
    assert ours.keys() == weights.keys()
    for name, original in weights.items():
        stored_f32 = original.ndim == 1 or name.endswith(("q_proj.weight", "k_proj.weight"))
        expected = original if stored_f32 else original.astype(np.float16).astype(np.float32)
        assert torch.equal(ours[name], torch.from_numpy(expected)), name


def test_tiny_matches_transformers(tiny):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    path, folder, _ = tiny
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ours = load_file(folder / "model.safetensors")
    expected = reference.state_dict()
    assert ours.keys() == expected.keys()
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name
    # config.json must describe the same model: same logits from our folder as from the GGUF.
    converted = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 70, 260, 261, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 8


def test_embedded_matches_transformers(embedded_dir, embedded_gguf):
    from transformers import AutoConfig, AutoModelForCausalLM

    from forerun.models.loader import ensure_float_weights

    ours = json.loads((embedded_dir / "config.json").read_text())
    reference = AutoConfig.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name)
    assert ours["model_type"] == "llama" and ours["architectures"] == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(reference, key), key
    assert math.isclose(ours["rms_norm_eps"], reference.rms_norm_eps, rel_tol=1e-6)
    assert math.isclose(ours["rope_theta"], reference.rope_parameters["rope_theta"], rel_tol=1e-6)
    assert ours["tie_word_embeddings"] is True and ours["rope_scaling"] is None

    model = AutoModelForCausalLM.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name)
    expected = model.state_dict()
    ensure_float_weights(embedded_dir)  # a converted folder holds float32 weights once a float precision needs them
    weights = load_file(embedded_dir / "model.safetensors")
    assert "lm_head.weight" not in weights and weights.keys() == expected.keys() - {"lm_head.weight"}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(weights[name], expected[name]), name  # same bytes, same dequantisation


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*nope.gguf"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_file(tiny, tmp_path, damage):
    data = tiny[0].read_bytes()
    broken = tmp_path / f"{damage}.gguf"
    broken.write_bytes({"truncated": data[: len(data) * 2 // 3], "garbage": b"\x00junk" * 1000, "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match=f"{damage}.gguf"):
        convert_gguf_to_hf(broken, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [broken]  # nothing half-written left behind


def test_unsupported_architecture(tmp_path):
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *gpt2_byte_chars()]
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, tiny_hf_weights(len(tokens)), tokens, [], arch="qwen3")
    with pytest.raises(ModelLoadError, match="other.gguf.*'qwen3' is not supported"):
        convert_gguf_to_hf(path, tmp_path / "out", progress=False)


def test_llama_refuses_a_bias_it_has_no_place_for(tmp_path):
    """Only qwen2 has q/k/v biases; in a llama file one must fail, not vanish from the model."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *gpt2_byte_chars(), "Ġt"]
    path = tmp_path / "biased.gguf"
    write_tiny_gguf(path, tiny_hf_weights(len(tokens), qkv_bias=True), tokens, ["Ġ t"])
    with pytest.raises(ModelLoadError, match="biased.gguf: unexpected tensor 'blk.0.attn_q.bias' for a llama"):
        convert_gguf_to_hf(path, tmp_path / "out", progress=False)
