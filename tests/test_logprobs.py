"""Log-probabilities are the verifier's own: a generated token's logprob is log_softmax of the
raw logits plain decoding computes at that position, whatever drafted it (chains, trees, a
draft model's probabilistic q), batched or not, greedy or sampled. At the batch-invariant
precisions (float32 and int8 with the compiled kernels) the values are equal bit for bit to
a one-token-at-a-time replay of the same tokens, which is what plain decoding runs."""
import math

import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.errors import ConfigError
from forerun.kv.cache import chain_batch
from forerun.llm import LLM
from forerun.logprobs import Logprob, token_logprobs
from forerun.metrics import merge
from forerun.kernels import loader as kernel_loader
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1]]
KERNELS = kernel_loader.load() is not None


def test_token_logprobs_are_the_raw_log_softmax_with_ranks():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 3.0])
    out = token_logprobs(logits, 3, 2)
    lp = torch.log_softmax(logits, -1)
    assert list(out) == [3, 1, 4]  # the chosen token first, then the top 2 (ties: topk's order)
    assert out[3] == Logprob(float(lp[3]), 5) and out[1].rank == 1 and out[4].rank == 2
    assert out[1].logprob == float(lp[1])
    assert list(token_logprobs(logits, 1, 0)) == [1]  # 0: the chosen token only
    assert token_logprobs(logits, 2, 3)[2].rank == 3  # the chosen token inside the top N keeps its rank


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=bad)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def _replay(model, prompt: list[int], generated: list[int]) -> list[torch.Tensor]:
    """Plain decoding's logits for `generated` after `prompt`: prefill, then one token a forward."""
    cache = model.new_cache(1, len(prompt) + len(generated) + 1)
    with torch.inference_mode():
        if len(prompt) > 1:
            model(chain_batch([prompt[:-1]], [0], [0], model.device), cache, logits_at=None)
        fed, rows = prompt[-1], []
        for i, tok in enumerate(generated):
            rows.append(model(chain_batch([[fed]], [len(prompt) - 1 + i], [0], model.device), cache).logits[0, 0])
            fed = tok
    return rows


def _check_exact(llm, outs, prompts, top: int):
    for out, prompt in zip(outs, prompts):
        assert len(out.logprobs) == len(out.token_ids)
        for entry, tok, logits in zip(out.logprobs, out.token_ids, _replay(llm.model, prompt, out.token_ids)):
            want = token_logprobs(logits, tok, top)
            assert {t: (lp.logprob, lp.rank) for t, lp in entry.items()} == {t: (lp.logprob, lp.rank) for t, lp in want.items()}
            assert tok in entry and len(entry) in (top, top + 1)
        assert out.cumulative_logprob == sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))


SPECS = {
    "plain": None,
    "ngram": dict(method="ngram", num_speculative_tokens=4, ngram_max=3),
    "ngram-tree": dict(method="ngram", num_speculative_tokens=4, ngram_max=3, ngram_min=1, ngram_branches=3),
    "draft_model": dict(method="draft_model", num_speculative_tokens=3),
    "draft_model-tree": dict(method="draft_model", num_speculative_tokens=3, tree_width=3),
}


@pytest.fixture(scope="module", params=["float32", "int8"])
def verifier(request):
    if not KERNELS:
        pytest.skip("bit-exact logprobs need the batch-invariant kernels")
    return LLM(tiny_model(seed=1, dtype=request.param, hidden_size=64, intermediate_size=128), dtype=request.param)


def _spec(name):
    spec = SPECS[name]
    if spec is None:
        return None
    if spec["method"] == "draft_model":
        spec = {**spec, "draft_model": LLM(tiny_model(seed=3, hidden_size=64, intermediate_size=128, dtype="float32"))}
    return SpeculativeConfig(**spec)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SPECS))
def test_logprobs_equal_plain_decodings_bit_for_bit(verifier, name, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5, logprobs=3)
    spec = _spec(name)
    outs = verifier.generate(PROMPTS, params, speculative=spec)  # batched: three rows in each forward
    _check_exact(verifier, outs, PROMPTS, 3)
    if spec is not None:
        assert merge([o.stats for o in outs]).drafted > 0


def test_logprobs_do_not_change_the_tokens(verifier):
    spec = _spec("ngram")
    for temperature in (0.0, 0.9):
        off = verifier.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=24, seed=5), speculative=spec)
        on = verifier.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=24, seed=5, logprobs=2), speculative=spec)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert all(o.logprobs is None and o.cumulative_logprob is None for o in off)


def test_greedy_tokens_rank_first(verifier):
    (out,) = verifier.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, logprobs=0))
    assert all(e[t].rank == 1 and len(e) == 1 for e, t in zip(out.logprobs, out.token_ids))


def test_a_stop_cut_keeps_one_logprob_per_token():
    llm = LLM(tiny_model(seed=0, dtype="float32"))
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30))[0].token_ids
    j = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # its first appearance
    llm.eos_ids = lambda: frozenset({free[j]})  # an EOS there: the step's later tokens are dropped
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, logprobs=1),
                       speculative=SpeculativeConfig("ngram", 5, ngram_max=3, ngram_min=1))[0]
    assert out.token_ids == free[: j + 1] and len(out.logprobs) == j + 1 and out.finish_reason == "stop"


def test_prompt_logprobs_are_teacher_forced():
    llm = LLM(tiny_model(seed=2, dtype="float64"))
    prompt = PROMPTS[2]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    full = torch.log_softmax(llm.model.score(prompt), -1)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert prompt[i] in entry and math.isclose(entry[prompt[i]].logprob, float(full[i - 1, prompt[i]]), rel_tol=1e-12)
        assert entry[prompt[i]].rank == int((full[i - 1] > full[i - 1, prompt[i]]).sum()) + 1
    assert out.logprobs is None  # prompt logprobs alone


def test_decoded_tokens_are_the_tokens_text():
    llm = LLM(progress=False)  # the embedded SmolLM2 (gguf)
    (out,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1))
    for entry in out.logprobs:
        for tok, lp in entry.items():
            assert lp.decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
    assert "".join(e[t].decoded_token for e, t in zip(out.logprobs, out.token_ids)) == llm.tokenizer.decode(out.token_ids)
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] is not None
