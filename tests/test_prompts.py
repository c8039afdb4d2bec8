"""Prompt-set loaders: the real data where it is present, small files in tmp_path otherwise."""

import gzip
import json
from collections import Counter

import pytest

import forerun.prompts
from forerun.errors import ForerunError
from forerun.prompts import SPEC_BENCH_SUBTASKS, Prompt, available_sets, data_dir, load_prompts

DATA = data_dir()
needs_data = pytest.mark.skipif(
    not (DATA / "spec_bench" / "question.jsonl").is_file(), reason=f"no prompt data at {DATA}"
)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---- the real sets ----


@needs_data
def test_spec_bench_all():
    prompts = load_prompts("spec_bench")
    assert len(prompts) == 480
    assert prompts[0].id == "spec_bench/81" and prompts[-1].id == "spec_bench/560"
    assert all(p.chat for p in prompts)
    counts = Counter(p.category for p in prompts)
    assert counts["writing"] == 10 and counts["translation"] == 80
    assert "mt_bench" not in counts  # the whole set keeps the file's own labels


@needs_data
@pytest.mark.parametrize("subtask", list(SPEC_BENCH_SUBTASKS))
def test_spec_bench_subtasks(subtask):
    prompts = load_prompts(f"spec_bench:{subtask}")
    assert len(prompts) == 80
    assert {p.category for p in prompts} == {subtask}
    ids = [int(p.id.split("/")[1]) for p in prompts]
    assert ids == list(SPEC_BENCH_SUBTASKS[subtask])


@needs_data
def test_mt_bench_is_ids_81_to_160_with_first_turn():
    prompts = load_prompts("spec_bench:mt_bench")
    assert [p.id for p in prompts] == [f"spec_bench/{i}" for i in range(81, 161)]
    first = json.loads((DATA / "spec_bench" / "question.jsonl").read_text().splitlines()[0])
    assert prompts[0].text == first["turns"][0]  # the first of its two turns


@needs_data
def test_spec_bench_category_label():
    prompts = load_prompts("spec_bench:writing")
    assert len(prompts) == 10
    assert {p.category for p in prompts} == {"writing"}


@needs_data
def test_humaneval_is_raw_completion():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[-1].id == "HumanEval/163"
    assert not any(p.chat for p in prompts)
    assert prompts[0].text.startswith("from typing import List")
    assert prompts[0].text.endswith('"""\n')  # the raw prompt, untouched


@needs_data
def test_svamp_joins_body_and_question():
    prompts = load_prompts("svamp")
    assert len(prompts) == 1000
    first = prompts[0]
    assert first.id == "svamp/chal-1" and first.chat
    assert first.text == (
        "Each pack of dvds costs 76 dollars. If there is a discount of 25 dollars on each pack"
        " How much do you have to pay to buy each pack?"
    )


@needs_data
def test_vicuna():
    prompts = load_prompts("vicuna")
    assert len(prompts) == 80
    assert prompts[0] == Prompt(
        "vicuna/1", "generic", "How can I improve my time management skills?", True
    )
    assert Counter(p.category for p in prompts)["coding"] == 7


@needs_data
def test_limit_takes_first_after_filter():
    prompts = load_prompts("spec_bench:qa", limit=3)
    assert [p.id for p in prompts] == ["spec_bench/321", "spec_bench/322", "spec_bench/323"]
    assert len(load_prompts("vicuna", limit=1000)) == 80


def test_available_sets():
    sets = available_sets()
    assert sets[0] == "spec_bench"
    assert {"spec_bench:mt_bench", "spec_bench:rag", "humaneval", "svamp", "vicuna"} <= set(sets)


# ---- custom JSONL ----


def test_custom_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"prompt": "def f(x):"})
        + "\n\n"  # a blank line is skipped, ids still follow line numbers
        + json.dumps({"prompt": "Hi", "chat": True, "category": "greet", "id": 7})
        + "\n"
        + json.dumps({"turns": ["first", "second"], "id": "t"})
        + "\n"
    )
    assert load_prompts(str(path)) == [
        Prompt("file:1", "file", "def f(x):", False),
        Prompt("7", "greet", "Hi", True),
        Prompt("t", "file", "first", True, ("first", "second")),
    ]
    assert load_prompts(str(path), limit=1) == [Prompt("file:1", "file", "def f(x):", False)]


def test_custom_jsonl_gz(tmp_path):
    path = tmp_path / "mine.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "x"}) + "\n")
    assert load_prompts(str(path)) == [Prompt("file:1", "file", "x", False)]


# ---- where the data is looked for ----


def test_env_var_override(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "vicuna_bench" / "question.jsonl",
                [{"question_id": 5, "category": "fermi", "turns": ["How many?"]}])
    monkeypatch.setenv("FORERUN_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    assert load_prompts("vicuna") == [Prompt("vicuna/5", "fermi", "How many?", True)]
    assert data_dir("/elsewhere").as_posix() == "/elsewhere"  # the argument beats the env var


def test_default_dir_prefers_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("FORERUN_DATA_DIR", raising=False)
    (tmp_path / "shared" / "data" / "prompts").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert data_dir() == (tmp_path / "shared" / "data" / "prompts").resolve()


def test_default_dir_falls_back_to_repo_root(tmp_path, monkeypatch):
    monkeypatch.delenv("FORERUN_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    repo_root = forerun.prompts._REPO_ROOT
    assert data_dir() == (repo_root / ".." / "shared" / "data" / "prompts").resolve()


# ---- errors ----


def test_unknown_spec_lists_valid_ones():
    valid = "spec_bench:mt_bench.*vicuna"
    with pytest.raises(ForerunError, match=f"unknown prompt set 'nope'.*{valid}"):
        load_prompts("nope")


def test_set_without_subtasks():
    with pytest.raises(ForerunError, match="no subtasks"):
        load_prompts("humaneval:easy")


@needs_data
def test_unknown_subtask_lists_subtasks_and_labels():
    with pytest.raises(ForerunError, match="'poetry'.*mt_bench.*rag.*writing"):
        load_prompts("spec_bench:poetry")


@pytest.mark.parametrize("spec", ["spec_bench", "spec_bench:qa", "humaneval", "svamp", "vicuna"])
def test_missing_data_file(tmp_path, spec):
    with pytest.raises(ForerunError) as info:
        load_prompts(spec, data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert str(tmp_path / "nowhere") in msg
    assert "not bundle" in msg and "provenance" in msg
    assert "https://github.com/" in msg
    assert "--data-dir" in msg and "FORERUN_DATA_DIR" in msg


def test_missing_custom_file(tmp_path):
    with pytest.raises(ForerunError, match="does not exist"):
        load_prompts(str(tmp_path / "absent.jsonl"))


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"category": "x"}', "needs 'prompt'"),
        ('{"prompt": 3}', "'prompt' should be str"),
        ('{"turns": []}', "non-empty list"),
        ('{"prompt": "x", "chat": "yes"}', "'chat' should be bool"),
    ],
)
def test_malformed_custom_row_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + bad_line + "\n")
    with pytest.raises(ForerunError, match=message) as info:
        load_prompts(str(path))
    assert f"{path}:2" in str(info.value)


def test_malformed_builtin_row(tmp_path):
    write_jsonl(tmp_path / "spec_bench" / "question.jsonl",
                [{"question_id": 81, "category": "writing", "turns": ["a"]},
                 {"question_id": 82, "category": "writing"}])
    with pytest.raises(ForerunError, match="question.jsonl:2: missing field 'turns'"):
        load_prompts("spec_bench", data_dir=tmp_path)


def test_malformed_svamp(tmp_path):
    (tmp_path / "SVAMP.json").write_text('[{"ID": "chal-1", "Body": "b"}]')
    with pytest.raises(ForerunError, match="record 1: missing field 'Question'"):
        load_prompts("svamp", data_dir=tmp_path)
    (tmp_path / "SVAMP.json").write_text("[\n{oops")
    with pytest.raises(ForerunError, match=r"SVAMP.json:2: not valid JSON"):
        load_prompts("svamp", data_dir=tmp_path)


@pytest.mark.parametrize("limit", [0, -1])
def test_bad_limit(limit):
    with pytest.raises(ForerunError, match="limit must be at least 1"):
        load_prompts("vicuna", limit=limit)
