"""A draft model whose head scores only part of the vocabulary (draft_vocab): the verifier
still decides over all of it, so greedy output is unchanged and sampling keeps its law."""
import pytest
import torch

from forerun.config import SamplingParams, SpeculativeConfig
from forerun.drafters.draft_vocab import kept_ids, reduced_head
from forerun.errors import ConfigError
from forerun.llm import LLM
from forerun.metrics import merge
from tests.stats_util import chi2_pvalue, joint_distribution
from tests.tiny import tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 9, 9], [30, 1, 30, 1, 30, 2, 7, 7, 8, 30, 1], [4]]


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8"])
def test_greedy_output_is_unchanged(dtype):
    verifier = LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=3), dtype=dtype)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    draft = LLM(tiny_model(seed=0, dtype=dtype, num_hidden_layers=2), dtype=dtype)  # related: many accepts
    spec = SpeculativeConfig("draft_model", 4, draft_model=draft, options={"draft_vocab": 12})
    outs = verifier.generate(PROMPTS, greedy, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.drafted > st.accepted
    assert verifier.drafter_for(spec).head.head.ids.tolist() == list(range(12))  # no tokenizer: no special ids


def test_sampling_keeps_the_verifiers_law():
    prompt, params = [1, 2, 3, 1, 2, 3, 1, 2], dict(temperature=0.8, top_p=0.9, max_tokens=4)
    verifier = LLM(tiny_model(seed=0, vocab_size=8))
    reference = joint_distribution(verifier.model, prompt, SamplingParams(**params), n=4)
    draft = LLM(tiny_model(seed=7, vocab_size=8))
    spec = SpeculativeConfig("draft_model", 2, draft_model=draft, options={"draft_vocab": 5})
    outs = verifier.generate([prompt] * 20_000, SamplingParams(**params, seed=5), speculative=spec)
    st = merge([o.stats for o in outs])
    assert st.accepted > 0 and st.rejections > 0 and st.bonus > 0
    assert chi2_pvalue([tuple(o.token_ids) for o in outs], reference) > 1e-3


def test_kept_ids_and_bad_values():
    assert kept_ids(6, 10, set()).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="draft_vocab"):
        SpeculativeConfig("draft_model", 4, options={"draft_vocab": 1})


def test_reduced_head_scores_extra_ids_like_the_full_head():
    llm = LLM(tiny_model(seed=0, dtype="float64", vocab_size=64), dtype="float64")
    head = reduced_head(SpeculativeConfig("draft_model", 4, options={"draft_vocab": 12}), llm, 64).head  # a ContextHead's
    hidden = torch.randn(3, llm.model.config.hidden_size, dtype=torch.float64)
    full = llm.model.hidden_to_logits(hidden)
    got = head(hidden, [20, 40])
    finite = torch.isfinite(got[0]).nonzero().flatten().tolist()
    assert finite == list(range(12)) + [20, 40]
    assert torch.allclose(got[:, [5, 20, 40]], full[:, [5, 20, 40]].float(), atol=1e-5)
    assert torch.isfinite(head(hidden)[0]).sum() == 12  # no extra ids: the kept set only


def test_context_ids_are_drafted():
    """Ids outside the kept set that the context holds (the prompt's, the output's so far):
    with draft_vocab_context the drafter (the verifier's own weights) proposes them, so only a
    token outside both can be rejected; without, every one outside the kept set is. Output is
    plain decoding's either way."""
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=2, vocab_size=64))
    greedy = SamplingParams(temperature=0, max_tokens=30)
    prompts = [[30, 41, 50, 30, 41, 50, 30, 41], [60, 33, 60, 33, 2]]
    plain = [o.token_ids for o in verifier.generate(prompts, greedy, speculative=None)]
    stats = {}
    for context in (True, False):
        draft = LLM(tiny_model(seed=0, num_hidden_layers=2, vocab_size=64))
        spec = SpeculativeConfig("draft_model", 4, draft_model=draft,
                                 options={"draft_vocab": 8, "draft_vocab_context": context})
        outs = verifier.generate(prompts, greedy, speculative=spec)
        assert [o.token_ids for o in outs] == plain
        stats[context] = merge([o.stats for o in outs])
    # with context, a rejection needs a token new to its row's context and outside the kept set
    new_outside = sum(len({t for t in out if t >= 8} - set(p)) for out, p in zip(plain, prompts))
    assert stats[True].rejections <= new_outside < stats[False].rejections
    assert stats[True].accepted > stats[False].accepted


def test_draft_vocab_context_must_be_a_bool():
    with pytest.raises(ConfigError, match="draft_vocab_context"):
        SpeculativeConfig("draft_model", 4, options={"draft_vocab": 8, "draft_vocab_context": "yes"})


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_float_rows_read_the_rows_of_every_head_kind(dtype):
    """float_rows gathers rows without unpacking the whole head (the float32 kernel's packed
    layout, int8 rows, int4 groups): the same values as the head's full weight."""
    from forerun.drafters.draft_vocab import float_rows

    llm = LLM(tiny_model(seed=0, vocab_size=64), dtype=dtype)
    head = llm.model.lm_head
    ids = torch.tensor([0, 5, 17, 40, 63])
    full = head.weight_int8.float() * head.weight_scale[:, None] if hasattr(head, "weight_int8") else head.weight
    assert torch.equal(float_rows(head, ids), full[ids])


def test_a_named_draft_model_gets_the_measured_defaults():
    """Naming only the draft model: int4 drafter (CPU, kernels), head cut to 32768 ids for a large
    vocabulary, lookup 1; each overridable; an LLM object is used as built."""
    import doctest

    from forerun.config import SpeculativeConfig
    from forerun.drafters import draft_model
    from forerun.kernels import loader as kernel_loader

    assert doctest.testmod(draft_model).failed == 0
    big = draft_model.with_named_defaults(SpeculativeConfig("draft_model", 4), 151936).options
    assert big == {"draft_vocab": 32768, "draft_lookup": 1}
    kept = draft_model.with_named_defaults(
        SpeculativeConfig("draft_model", 4, options={"draft_vocab": 0, "draft_lookup": 0}), 151936).options
    assert kept == {"draft_vocab": 0, "draft_lookup": 0}
    verifier = LLM(tiny_model(seed=0, dtype="float32"), dtype="float32")
    assert draft_model.named_draft_dtype(verifier) == ("int4" if kernel_loader.load() is not None else "float32")


def test_an_int4_q4k_head_keeps_its_kept_rows_blocks():
    """int4's Q4_K form (a head 256 wide): the reduced head takes its rows' blocks as they are,
    never re-fitted from their values (a re-fit does not always find the same blocks)."""
    from forerun.kernels import loader as kernel_loader

    if kernel_loader.load() is None:
        pytest.skip("int4 needs the compiled kernels")
    llm = LLM(tiny_model(seed=0, dtype="int4", vocab_size=64, hidden_size=256, intermediate_size=512), dtype="int4")
    sub = reduced_head(SpeculativeConfig("draft_model", 4, options={"draft_vocab": 12}), llm, 64).head.head
    assert [p.type for p in sub.parts] == [12]
    assert torch.equal(sub.weight, llm.model.lm_head.float_rows(torch.arange(12)))


def test_prompts_are_written_in_the_prefill():
    """generate hands the draft model the prompts in its prefill (as the verifier's): the
    first drafting step then feeds one token (plus the lookup's guesses), and the output is
    plain decoding's."""
    verifier = LLM(tiny_model(seed=0, num_hidden_layers=3))
    draft = LLM(tiny_model(seed=0, num_hidden_layers=2))
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain = [o.token_ids for o in verifier.generate(PROMPTS, greedy, speculative=None)]
    spec = SpeculativeConfig("draft_model", 3, draft_model=draft)
    drafter = verifier.drafter_for(spec)
    widths, forward = [], draft.model.forward
    draft.model.forward = lambda batch, *a, **kw: widths.append(batch.tokens.shape[1]) or forward(batch, *a, **kw)
    outs = verifier.generate(PROMPTS, greedy, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    assert drafter.prompt_seconds > 0 and drafter.fed_tokens >= sum(len(p) for p in PROMPTS)
    first_step = widths.index(1)  # after the prefill's forwards (their width: the longest prompt)
    assert widths[:first_step] == [max(len(p) for p in PROMPTS)] and max(widths[first_step:]) <= 2


def test_pick_is_the_argmax_of_the_full_row():
    """A greedy drafter's pick (no verifier-wide row written) equals argmax over forward()'s
    row: ties go to the lower id, whether kept or extra, and a NaN counts as the largest."""
    from forerun.drafters.draft_vocab import ReducedHead

    torch.manual_seed(0)
    full = torch.nn.Linear(16, 64, bias=False)
    with torch.no_grad():  # small integers: every kernel's sums are exact, so ties are real ties
        full.weight.copy_(torch.randint(-2, 3, (64, 16)))
        full.weight[50] = full.weight[20] = full.weight[7] * 3  # kept 50 and extra 20 tie
    head = ReducedHead(full, torch.tensor([0, 1, 2, 7, 50, 60]), 64, "float32")
    hidden = torch.randint(-2, 3, (40, 16)).float()
    hidden[:20] = full.weight[7].detach()  # rows where 20 and 50 tie at the top: the extra id is lower
    for extra in (None, [20, 40], [3, 20]):
        assert head.pick(hidden, extra) == head(hidden, extra).argmax(-1).tolist()
    assert set(head.pick(hidden[:20], [20])) == {20}
    with torch.no_grad():
        full.weight[40] = float("nan")
    head._extra = None  # the extra rows are read again
    assert head.pick(hidden, [20, 40]) == [40] * 40 == head(hidden, [20, 40]).argmax(-1).tolist()
