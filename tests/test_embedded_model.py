"""The real embedded model (SmolLM2-135M-Instruct): the default precision (gguf, the file's own
blocks) against float32, float32's logits against transformers', and greedy identity of two
drafters (n-gram at several k, the draft model) plus the chat API and streamed text with stop
strings at gguf. Short generations keep this file around a minute."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from tests.tiny import truncated_copy

CHATS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize: The city council approved the new budget on Tuesday. The budget increases "
    "funding for parks and public transport, while cutting administrative costs by five percent.",
    "What is the capital of France? Answer in one sentence.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def llm(embedded_dir):
    """The default precision: gguf, the file's own Q4_1 / Q8_0 blocks."""
    return LLM(model=str(embedded_dir), progress=False)


@pytest.fixture(scope="module")
def llm_f32(embedded_dir):
    """float32: the file's weights dequantized exactly."""
    return LLM(model=str(embedded_dir), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def plain(llm, prompts):
    return [llm.generate(p, GREEDY, speculative=None)[0].token_ids for p in prompts]


def test_the_default_precision_is_the_files_own_blocks(llm, llm_f32, prompts):
    """gguf by default; against float32 (the same weights, float activations) its per-token KL
    stays small and its argmax agrees almost everywhere."""
    assert llm.dtype == "gguf" and llm_f32.dtype == "float32"
    ids = llm.encode([prompts[0]])[0]
    a, b = llm.model.score(ids).log_softmax(-1), llm_f32.model.score(ids).log_softmax(-1)
    kl = (b.exp() * (b - a)).sum(-1)
    assert kl.mean() < 0.02 and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_the_tied_table_is_held_once_and_looks_up_the_files_rows(llm, llm_f32):
    """SmolLM2 ties its head to its Q8_0 embedding: the table is held once. Where the head is
    packed for the VNNI kernel, the embedding reads its rows from that packed copy; elsewhere
    both hold the file's own blocks. Either way the rows are the file's values."""
    from forerun.linears.gguf import packed_simd

    emb, head = llm.model.model.embed_tokens, llm.model.lm_head
    assert emb.blocks is head.parts[0]
    assert bool(head.parts[0].packed_rows) == packed_simd()
    ids = torch.tensor([[0, 17, 49151, 17]])
    assert torch.equal(emb(ids), llm_f32.model.model.embed_tokens(ids))


def test_logits_match_transformers(llm_f32, embedded_gguf, prompts):
    llm = llm_f32
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(embedded_gguf.parent), gguf_file=embedded_gguf.name, dtype=torch.float32
    ).eval()
    ids = llm.encode([prompts[0]])[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = llm.model(chain_batch([ids], [0], [0], llm.model.device), llm.model.new_cache(1, len(ids))).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("k", [3, 6])
def test_ngram_greedy_identity(llm, prompts, plain, k):
    outs = [llm.generate(p, GREEDY, speculative=SpeculativeConfig("ngram", k))[0] for p in prompts]
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted for o in outs) > 0


def test_draft_model_greedy_identity(llm, llm_f32, prompts, plain):
    """A truncated float32 copy of the verifier (first 8 of 30 layers) drafts; no speed claim."""
    draft = LLM(truncated_copy(llm_f32.model, 8), tokenizer=llm.tokenizer)
    outs = [llm.generate(p, GREEDY, speculative=SpeculativeConfig("draft_model", 4, draft_model=draft))[0] for p in prompts]
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.accepted for o in outs) > 0


def test_chat_api_and_text(llm, plain):
    out = llm.chat([{"role": "user", "content": CHATS[2]}], GREEDY)[0]
    assert out.token_ids == plain[2]
    assert "Paris" in out.text


def test_streamed_text_equals_final_text_with_stop_strings(llm, prompts):
    pieces = []
    params = SamplingParams(temperature=0, max_tokens=40, stop=["\n"])
    out = llm.generate(prompts[0], params, speculative=SpeculativeConfig("ngram", 4),
                       stream=lambda i, t: pieces.append(t))[0]
    assert "".join(pieces) == out.text and "\n" not in out.text
    assert out.finish_reason == "stop" and len(out.token_ids) < 40
