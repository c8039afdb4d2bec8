"""One row's grammar state, driven token by token with a real tokenizer (the embedded SmolLM2's):
whatever allowed token is picked (the highest id, or a seeded random one) the output is valid;
rollback restores the state; forced runs are exactly the only allowed tokens; a draft is checked
position by position, each against its own state, and the state is left as it was."""
import doctest
import json
import random
import re

import pytest
import torch

from forerun.structured import GrammarCompiler, RowMatcher, StructuredOutputs, fill_masks, matcher
from forerun.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(embedded_dir):
    return GrammarCompiler(Tokenizer.from_pretrained(embedded_dir))


def _ids(compiler, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def generate(m: RowMatcher, pick, limit: int = 400) -> list[int]:
    """Tokens chosen by pick(allowed ids) until EOS; each pick checked against the grammar."""
    out = []
    for _ in range(limit):
        allowed = m.mask().nonzero().flatten().tolist()
        assert allowed, "the grammar allows no token at all"
        token = pick(allowed)
        if token in m.eos_ids:
            assert m.accepts_eos
            return out
        assert m.advance(token)
        out.append(token)
    raise AssertionError(f"no EOS within {limit} tokens")


def _highest(allowed):
    return max(allowed)


def _seeded(seed):
    rng = random.Random(seed)
    return lambda allowed: rng.choice(allowed)


def _is_person(value) -> bool:
    """PERSON checked by hand."""
    p = PERSON["properties"]
    return (isinstance(value, dict) and list(value) == list(p)
            and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and value["role"] in ("admin", "user")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, str) and re.fullmatch("[a-z]{1,4}", t) for t in value["tags"])
            and isinstance(value["active"], bool))


def test_doctests():
    assert doctest.testmod(matcher).failed == 0


@pytest.mark.parametrize("pick", [_highest, _seeded(0), _seeded(1), _seeded(2)], ids=["highest", "seed0", "seed1", "seed2"])
def test_a_json_schema_holds_whatever_allowed_token_is_picked(compiler, pick):
    m = compiler.matcher(StructuredOutputs(json=PERSON))
    text = compiler.tokenizer.decode(generate(m, pick))
    value = json.loads(text)
    assert _is_person(value), text
    structure = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # strings may hold spaces; the rest may not
    assert not re.search(r"\s", structure), text


@pytest.mark.parametrize("seed", range(4))
def test_a_regex_holds_whatever_allowed_token_is_picked(compiler, seed):
    pattern = r"[a-z]{2,6}@(example|test)\.(com|org)"
    picks = [_highest, _seeded(seed)]
    for pick in picks:
        text = compiler.tokenizer.decode(generate(compiler.matcher(StructuredOutputs(regex=pattern)), pick))
        assert re.fullmatch(pattern, text), text


def test_a_choice_yields_one_of_the_choices(compiler):
    choices = ["positive", "negative", "neutral", "mixed feelings"]
    spec = StructuredOutputs(choice=choices)
    seen = {compiler.tokenizer.decode(generate(compiler.matcher(spec), _seeded(seed))) for seed in range(24)}
    assert seen <= set(choices) and len(seen) > 1


def test_a_lark_grammar_holds_whatever_allowed_token_is_picked(compiler):
    lark = 'start: "[" NUM ("," NUM)~0..3 "]"\nNUM: /[1-9][0-9]{0,2}/'
    for seed in range(4):
        text = compiler.tokenizer.decode(generate(compiler.matcher(StructuredOutputs(grammar=lark)), _seeded(seed)))
        assert re.fullmatch(r"\[[1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,3}\]", text), text


def test_eos_is_allowed_exactly_when_the_output_is_complete(compiler):
    m = compiler.matcher(StructuredOutputs(regex="ab(cd)?"))
    eos = sorted(m.eos_ids)
    assert not m.mask()[eos].any() and not m.accepts_eos and not m.advance(eos[0])
    for token in _ids(compiler, "ab"):
        assert m.advance(token)
    assert m.mask()[eos].all() and m.accepts_eos and not m.is_done
    for token in _ids(compiler, "cd"):
        assert m.advance(token)
    assert m.is_done and m.accepts_eos and m.mask().nonzero().flatten().tolist() == eos  # nothing but EOS left
    consumed = m.consumed
    assert m.check_draft([eos[0], eos[0]]) == 1 and m.consumed == consumed
    assert m.advance(eos[0]) and m.ended and m.consumed == consumed + 1 and m.error is None
    assert not m.advance(eos[0]) and not m.accepts_eos and m.check_draft([eos[0]]) == 0
    assert m.mask().nonzero().flatten().tolist() == eos
    m.rollback(1)  # the EOS, with its KV entry
    assert not m.ended and m.is_done and m.accepts_eos and m.consumed == consumed
    m.rollback(1)
    assert not m.is_done and m.accepts_eos and m.mask().sum() > len(eos)
    fresh = compiler.matcher(StructuredOutputs(regex="ab(cd)?"))
    whole = _ids(compiler, "ab") + _ids(compiler, "cd")
    assert fresh.check_draft(whole + [eos[0], whole[0]]) == len(whole) + 1
    assert fresh.check_draft(_ids(compiler, "a") + [eos[0]]) == 1  # "a" is not complete
    masks = fresh.draft_masks(whole + [eos[0], whole[0]])
    assert masks.shape[0] == len(whole) + 2 and masks[-1].nonzero().flatten().tolist() == eos


def test_a_refused_token_leaves_the_state_unchanged(compiler):
    m = compiler.matcher(StructuredOutputs(regex="[0-9]+"))
    before = m.mask()
    assert not m.advance(_ids(compiler, "x")[0]) and not m.advance(-1) and not m.advance(10**9)
    assert m.consumed == 0 and torch.equal(m.mask(), before) and m.error is None


def test_rollback_restores_the_state(compiler):
    m = compiler.matcher(StructuredOutputs(json=PERSON))
    doc = _ids(compiler, '{"name":"Ada","age":36,"role":"admin","tags":["x"],"active":true}')
    for token in doc[:3]:
        assert m.advance(token)
    before = m.mask()
    for token in doc[3:]:
        assert m.advance(token)
    assert m.accepts_eos and not torch.equal(m.mask(), before)
    m.rollback(len(doc) - 3)
    assert m.consumed == 3 and torch.equal(m.mask(), before)
    assert m.check_draft(doc[3:]) == len(doc) - 3  # and it goes forward again the same way
    with pytest.raises(ValueError, match="consumed 3 tokens"):
        m.rollback(4)


def test_masks_are_padded_to_the_model_vocabulary(compiler):
    m = compiler.matcher(StructuredOutputs(json_object=True))
    n = compiler.tokenizer.vocab_size
    padded = m.mask(n + 37)
    assert padded.shape == (n + 37,) and padded.dtype == torch.bool
    assert torch.equal(padded[:n], m.mask()) and not padded[n:].any()
    with pytest.raises(ValueError, match="below the tokenizer"):
        m.mask(n - 1)


def test_forced_tokens_on_fixed_keys_are_exactly_the_only_allowed_ones(compiler):
    m = compiler.matcher(StructuredOutputs(json=PERSON))
    before = m.mask()
    run = m.forced(16)
    assert run and m.consumed == 0 and torch.equal(m.mask(), before)  # state unchanged
    assert compiler.tokenizer.decode(run).startswith('{"name')
    for token in run:
        assert m.mask().nonzero().flatten().tolist() == [token]
        assert m.advance(token)
    assert m.mask().sum() > 1  # the run stops where a choice begins
    assert m.forced(16) == []


def test_forced_runs_stop_at_max_n_and_continue_after_the_value(compiler):
    m = compiler.matcher(StructuredOutputs(json=PERSON))
    run = m.forced(16)
    assert m.forced(1) == run[:1]
    for token in run + _ids(compiler, '":"Ada"'):
        assert m.advance(token)
    after_name = m.forced(16)  # ,"age": is fixed by the schema's order
    assert compiler.tokenizer.decode(after_name).startswith(',"age')


def test_forced_never_includes_eos(compiler):
    m = compiler.matcher(StructuredOutputs(regex="ok"))
    for token in m.forced(8):
        assert m.advance(token)
    assert m.is_done and m.forced(8) == []


def test_a_draft_is_checked_position_by_position(compiler):
    spec = StructuredOutputs(json=PERSON)
    good = _ids(compiler, '{"name":"Ada","age":36')
    bad = _ids(compiler, ',"age":-1')  # -1 is below the minimum
    m = compiler.matcher(spec)
    n = m.check_draft(good + bad)
    assert len(good) < n < len(good) + len(bad) and m.consumed == 0
    stepped = compiler.matcher(spec)
    assert all(stepped.advance(t) for t in (good + bad)[:n]) and not stepped.advance((good + bad)[n])
    assert m.check_draft([]) == 0 and m.check_draft([-5]) == 0 and m.check_draft(good + [10**9]) == len(good)


def test_draft_masks_are_the_masks_of_each_drafted_position(compiler):
    m = compiler.matcher(StructuredOutputs(json=PERSON))
    draft = _ids(compiler, '{"name":"Ada","age":36') + _ids(compiler, "!!")
    width = compiler.tokenizer.vocab_size + 7
    masks = m.draft_masks(draft, width)
    n = m.check_draft(draft)
    assert masks.shape == (n + 1, width) and m.consumed == 0
    stepped = compiler.matcher(StructuredOutputs(json=PERSON))
    for i in range(n + 1):
        assert torch.equal(masks[i], stepped.mask(width)), f"position {i}"
        if i < n:
            assert masks[i, draft[i]] and stepped.advance(draft[i])
    assert not masks[n, draft[n]]  # the first refused token is masked out at its own position


def test_fill_masks_matches_each_rows_mask(compiler):
    rows = [compiler.matcher(StructuredOutputs(json=PERSON)), compiler.matcher(StructuredOutputs(regex="[0-9]{2}")),
            compiler.matcher(StructuredOutputs(choice=["yes", "no"])), compiler.matcher(StructuredOutputs(json=PERSON))]
    for token in _ids(compiler, '{"name":"B'):
        assert rows[3].advance(token)
    for token in _ids(compiler, "no") + sorted(rows[2].eos_ids)[:1]:
        assert rows[2].advance(token)
    assert rows[2].ended
    width = compiler.tokenizer.vocab_size + 5
    out = torch.ones(len(rows), width, dtype=torch.bool)
    fill_masks(rows, out)
    for i, row in enumerate(rows):
        assert torch.equal(out[i], row.mask(width)), f"row {i}"
    with pytest.raises(ValueError, match="CPU bool tensor"):
        fill_masks(rows, torch.zeros(len(rows), width))
