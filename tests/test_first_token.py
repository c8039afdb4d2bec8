"""The first token comes out of the prefill: the prefill computes the whole prompt, and the last
prompt token's logits give the first token, as in any server (no decoding step of its own, so the
time to first token loses a step). Those logits are the bits a decoding step feeding that token
computes, at every kernel precision, so no token changes; a first token that ends the request
(EOS, max_tokens 1) ends it without a step."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.engine import GenerateJob, Sequence, generate, prefill
from forerun.kernels import loader as kernel_loader
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from tests.tiny import tiny_model

PROMPT = [(7 * i * i + 3 * i + 1) % 61 + 1 for i in range(150)]  # past a prefill forward's 128 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _counting(model):
    """The model, with a count of its forwards in `model.forwards`."""
    model.forwards, real = 0, model.forward

    def forward(*args, **kwargs):
        model.forwards += 1
        return real(*args, **kwargs)

    model.forward = forward
    return model


def _from_scratch(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens, each the argmax of a fresh forward over everything before it."""
    out = []
    for _ in range(n):
        out.append(int(model.score(prompt + out, last_only=True).argmax()))
    return out


def test_the_first_token_streams_after_the_prefill_forwards_alone():
    model = _counting(tiny_model(seed=0, vocab_size=64, max_position_embeddings=512))
    at_first = []
    job = GenerateJob([PROMPT, PROMPT[:9]], GREEDY, [12, 12],
                      on_tokens=lambda i, gen, done: at_first.append((i, model.forwards)) if len(gen) == 1 else None)
    seqs = generate(model, job)
    assert sorted(at_first) == [(0, 2), (1, 2)]  # 159 prompt tokens: two prefill forwards, no step yet
    for s, p in zip(seqs, (PROMPT, PROMPT[:9])):
        assert s.generated == _from_scratch(model, p, 12)
        assert s.stats.prefill_tokens == 1 and s.stats.verifier_forwards == 11 and s.stats.origins[0] == "p"
        assert s.stats.mean_accepted_length == 1.0  # tau counts the steps' tokens only


@pytest.mark.parametrize("first", ["eos", "length"])
def test_a_first_token_that_ends_the_request_takes_no_step(first):
    model = _counting(tiny_model(seed=0, vocab_size=64))
    want = _from_scratch(model, PROMPT[:20], 1)[0]
    eos = frozenset({want}) if first == "eos" else frozenset()
    n = 1 if first == "length" else 5
    model.forwards = 0
    (s,) = generate(model, GenerateJob([PROMPT[:20]], GREEDY, [n], eos_ids=eos))
    assert s.generated == [want] and s.finish_reason == ("stop" if first == "eos" else "length")
    assert model.forwards == 1 and s.stats.verifier_forwards == 0


def test_speculative_first_steps_draft_after_the_first_token():
    """A drafter's first proposal already follows the prefill's token (the draft model's cache
    holds the whole prompt, fed in the prefill); the output is plain decoding's."""
    verifier = LLM(tiny_model(seed=0, vocab_size=64))
    spec = SpeculativeConfig("draft_model", 3, draft_model=verifier)  # itself: every draft accepted
    out = verifier.generate([PROMPT[:20]], GREEDY, speculative=spec)[0]
    assert out.token_ids == _from_scratch(verifier.model, PROMPT[:20], 12)
    st = out.stats
    assert st.prefill_tokens == 1 and st.verifier_forwards == 3 and st.accepted == 8  # 1 + 3 x (3 + 1) = 13 >= 12


@pytest.mark.skipif(kernel_loader.load() is None, reason="needs the compiled kernels")
@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
def test_the_prefills_last_logits_are_a_decoding_steps_bits(dtype):
    """torch.equal: the first token's logits (the prefill's hidden state of the last prompt token
    through the LM head) against the logits of a step that feeds that token after the rest."""
    model = tiny_model(seed=4, dtype=dtype, vocab_size=64, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=512)
    prompts = [PROMPT, PROMPT[:90], PROMPT[:5]]
    with torch.inference_mode():
        cache = model.new_cache(3, 151)
        seqs = [Sequence(i, list(p), len(p), 1) for i, p in enumerate(prompts)]
        first = model.hidden_to_logits(prefill(model, cache, seqs))[:, 0]  # [3, V]
        for i, p in enumerate(prompts):
            step = model.new_cache(1, len(p))
            model(chain_batch([p[:-1]], [0], [0], model.device), step, logits_at=None)
            want = model(chain_batch([p[-1:]], [len(p) - 1], [0], model.device), step).logits[0, -1]
            assert torch.equal(first[i], want)
            assert cache.lengths[i] == len(p)
