"""Benchmark prompt sets: Spec-Bench, HumanEval, SVAMP, Vicuna-Bench, or your own JSONL file.

forerun does not bundle these sets: each must stay a byte-for-byte copy of its upstream file,
so that its provenance and license are checkable (see SOURCES.md in the data directory).
Point `data_dir` at a directory laid out like this:

    spec_bench/question.jsonl     480 chat prompts, Spec-Bench's six subtasks
    HumanEval.jsonl.gz            164 raw code-completion prompts
    SVAMP.json                    1000 short arithmetic word problems (one JSON array)
    vicuna_bench/question.jsonl   80 open-ended chat prompts

A custom file is JSONL with one object a line, holding either `prompt` (str; a raw completion
unless the row says "chat": true) or `turns` (list of str: user turns, as chat; `forerun bench
--turns N` plays up to N of them as a session, each resending the history), and optionally
`id` and `category`:

    {"prompt": "def fib(n):", "category": "code"}
    {"turns": ["Tell me a joke."], "id": "joke"}
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forerun.errors import ForerunError

ENV_VAR = "FORERUN_DATA_DIR"
_DEFAULT_DIR = Path("..", "shared", "data", "prompts")  # relative to cwd, then the repo root
_REPO_ROOT = Path(__file__).resolve().parent.parent

# Spec-Bench's subtasks are blocks of question_id. The MT-Bench block keeps MT-Bench's own
# eight category labels (writing, roleplay, ...), so "mt_bench" exists only as this range.
SPEC_BENCH_SUBTASKS: dict[str, range] = {
    "mt_bench": range(81, 161),
    "translation": range(161, 241),
    "summarization": range(241, 321),
    "qa": range(321, 401),
    "math_reasoning": range(401, 481),
    "rag": range(481, 561),
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    chat=True: render [{"role": "user", "content": text}] with the model's chat template.
    chat=False: feed `text` to the model as is (raw completion).
    """

    id: str  # "spec_bench/241", "HumanEval/0", "svamp/chal-1", "vicuna/1", "file:3"
    category: str  # what per-category reports group by
    text: str
    chat: bool
    turns: tuple[str, ...] = ()  # every user turn of a multi-turn row (MT-Bench's two), text being the first


def data_dir(override: str | Path | None = None) -> Path:
    """The prompt-data directory: `override`, else $FORERUN_DATA_DIR, else ../shared/data/prompts.

    The default is looked for relative to the working directory, then to the repo root;
    when neither exists the repo-root one is returned, so error messages name a real place.
    """
    if override is not None:
        return Path(override).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    candidates = [Path.cwd() / _DEFAULT_DIR, _REPO_ROOT / _DEFAULT_DIR]
    found = next((c for c in candidates if c.is_dir()), candidates[-1])
    return found.resolve()


def available_sets() -> list[str]:
    """The built-in specs. `spec_bench:<category label>` and a JSONL path also work."""
    subtasks = [f"spec_bench:{name}" for name in SPEC_BENCH_SUBTASKS]
    return ["spec_bench", *subtasks, *(name for name in _SETS if name != "spec_bench")]


def load_prompts(
    spec: str, limit: int | None = None, data_dir: str | Path | None = None
) -> list[Prompt]:
    """Load a prompt set in file order; `limit` keeps the first N (after any subtask filter).

    spec: "spec_bench", "spec_bench:<subtask or category label>", "humaneval", "svamp",
    "vicuna", or a path to a JSONL file. `data_dir` overrides where built-in sets are read.
    """
    if limit is not None and limit < 1:
        raise ForerunError(f"limit must be at least 1, got {limit}")
    prompts = _load(spec, data_dir)
    return prompts if limit is None else prompts[:limit]


def _load(spec: str, override: str | Path | None) -> list[Prompt]:
    name, sep, subtask = spec.partition(":")
    if name in _SETS:
        if sep and name != "spec_bench":
            raise ForerunError(f"prompt set {name!r} has no subtasks (got {spec!r})")
        path = _data_file(name, override)
        if sep:
            return _load_spec_bench(path, subtask)
        return _SETS[name].load(path)
    if _looks_like_path(spec):
        return _load_custom(Path(spec).expanduser())
    raise ForerunError(
        f"unknown prompt set {spec!r}; choose one of {', '.join(available_sets())}, "
        "spec_bench:<category label> (e.g. spec_bench:writing), or a path to a .jsonl file"
    )


def records(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """The rows of a built-in JSONL set as stored, every field kept (HumanEval's `test` and
    `entry_point` for `forerun eval humaneval`); a missing file gets the same message as
    load_prompts."""
    if name not in _SETS or name == "svamp":
        raise ForerunError(f"records() reads the JSONL sets ({', '.join(n for n in _SETS if n != 'svamp')}), not {name!r}")
    return [row for _, row in _read_jsonl(_data_file(name, data_dir))]


def _looks_like_path(spec: str) -> bool:
    if spec.endswith((".jsonl", ".jsonl.gz")) or "/" in spec or os.sep in spec:
        return True
    return Path(spec).exists()


@dataclass(frozen=True)
class _Set:
    file: str  # relative to the data directory
    upstream: str  # where to get the file
    load: Callable[[Path], list[Prompt]]


def _data_file(name: str, override: str | Path | None) -> Path:
    """The set's file in the data directory, or an error that says how to get it."""
    entry = _SETS[name]
    path = data_dir(override) / entry.file
    if not path.is_file():
        raise ForerunError(
            f"prompt set {name!r}: no file at {path}. forerun does not bundle its prompt sets "
            f"(each must stay a verified copy of its upstream file, for provenance); "
            f"get it from {entry.upstream} and put it at that path, or point --data-dir "
            f"or ${ENV_VAR} at a directory that holds {entry.file}"
        )
    return path


# ---- readers: every malformed record names its file and line (or record number) ----


def read_text(path: Path) -> str:
    """The file's text (gunzipped for .gz); a file that is not UTF-8 is refused with the line
    and byte where it stops being UTF-8."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ForerunError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                           "save the file as UTF-8") from None


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (where, row) for each non-blank line; `where` is "path:line" for messages."""
    for lineno, line in enumerate(read_text(path).split("\n"), start=1):  # (not splitlines: JSON strings may hold U+2028)
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ForerunError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ForerunError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _field(row: dict, key: str, kind: type, where: str):
    if key not in row:
        raise ForerunError(f"{where}: missing field {key!r}")
    value = row[key]
    if not isinstance(value, kind):
        raise ForerunError(
            f"{where}: field {key!r} should be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _first_turn(row: dict, where: str) -> str:
    return _turns(row, where)[0]


def _turns(row: dict, where: str) -> tuple[str, ...]:
    turns = _field(row, "turns", list, where)
    if not turns or not all(isinstance(t, str) for t in turns):
        raise ForerunError(f"{where}: field 'turns' should be a non-empty list of strings")
    return tuple(turns)


def _later(turns: tuple[str, ...]) -> tuple[str, ...]:
    """Prompt.turns: every turn where there are several, else none."""
    return turns if len(turns) > 1 else ()


# ---- one loader per set ----


def _load_spec_bench(path: Path, subtask: str | None = None) -> list[Prompt]:
    """All 480 prompts (category = the file's label), one subtask, or one category label."""
    rows = []  # (question_id, label, turns)
    for where, row in _read_jsonl(path):
        qid = _field(row, "question_id", int, where)
        rows.append((qid, _field(row, "category", str, where), _turns(row, where)))
    if subtask is None:
        return [Prompt(f"spec_bench/{q}", label, t[0], True, _later(t)) for q, label, t in rows]
    if subtask in SPEC_BENCH_SUBTASKS:
        ids = SPEC_BENCH_SUBTASKS[subtask]
        return [Prompt(f"spec_bench/{q}", subtask, t[0], True, _later(t)) for q, _, t in rows if q in ids]
    labels = list(dict.fromkeys(label for _, label, _ in rows))
    if subtask not in labels:
        raise ForerunError(
            f"unknown Spec-Bench subtask {subtask!r}; subtasks: {', '.join(SPEC_BENCH_SUBTASKS)}; "
            f"category labels: {', '.join(labels)}"
        )
    return [Prompt(f"spec_bench/{q}", lab, t[0], True, _later(t)) for q, lab, t in rows if lab == subtask]


def _load_humaneval(path: Path) -> list[Prompt]:
    # Raw completion: the prompt is a signature plus docstring that the model continues.
    prompts = []
    for where, row in _read_jsonl(path):
        text = _field(row, "prompt", str, where)
        prompts.append(Prompt(_field(row, "task_id", str, where), "humaneval", text, False))
    return prompts


def _load_svamp(path: Path) -> list[Prompt]:
    try:
        records = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ForerunError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(records, list):
        raise ForerunError(f"{path}: expected a JSON array of problems")
    prompts = []
    for i, rec in enumerate(records, start=1):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise ForerunError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        text = _field(rec, "Body", str, where) + " " + _field(rec, "Question", str, where)
        prompts.append(Prompt(f"svamp/{_field(rec, 'ID', str, where)}", "svamp", text, True))
    return prompts


def _load_vicuna(path: Path) -> list[Prompt]:
    return [
        Prompt(
            f"vicuna/{_field(row, 'question_id', int, where)}",
            _field(row, "category", str, where),
            _first_turn(row, where),
            True,
            _later(_turns(row, where)),
        )
        for where, row in _read_jsonl(path)
    ]


def _load_custom(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise ForerunError(f"prompt file {path} does not exist")
    prompts = []
    for where, row in _read_jsonl(path):
        turns = ()
        if "prompt" in row:
            text = _field(row, "prompt", str, where)
            chat = _field(row, "chat", bool, where) if "chat" in row else False
        elif "turns" in row:
            text, chat, turns = _first_turn(row, where), True, _later(_turns(row, where))
        else:
            raise ForerunError(f"{where}: a row needs 'prompt' (str) or 'turns' (list of str)")
        line = where.rsplit(":", 1)[1]  # the default id is the line number, easy to find
        pid = str(row["id"]) if "id" in row else f"file:{line}"
        category = _field(row, "category", str, where) if "category" in row else "file"
        prompts.append(Prompt(pid, category, text, chat, turns))
    return prompts


_SETS: dict[str, _Set] = {
    "spec_bench": _Set(
        "spec_bench/question.jsonl",
        "https://github.com/hemingkx/Spec-Bench (data/spec_bench/question.jsonl)",
        _load_spec_bench,
    ),
    "humaneval": _Set(
        "HumanEval.jsonl.gz",
        "https://github.com/openai/human-eval (data/HumanEval.jsonl.gz)",
        _load_humaneval,
    ),
    "svamp": _Set("SVAMP.json", "https://github.com/arkilpatel/SVAMP (SVAMP.json)", _load_svamp),
    "vicuna": _Set(
        "vicuna_bench/question.jsonl",
        "https://github.com/lm-sys/FastChat (fastchat/llm_judge/data/vicuna_bench/question.jsonl)",
        _load_vicuna,
    ),
}
