"""Training text: files, folders and installed packages' source and documentation, read in a
fixed order, tokenized, and cut into equal chunks.

Files are read in a seeded shuffle of all the sources' files (sorted first), so a token
budget smaller than the data still samples every source and package corner.

Refused on purpose (a head must not be fitted on what it is measured on, nor on code every
Python user has seen it write): anything under the benchmark prompt folder
(forerun.prompts.data_dir: Spec-Bench, HumanEval, SVAMP, Vicuna) and Python's standard
library. Site-packages are fine: `pkg:numpy` reads numpy's .py, .pyi, .md, .rst, .txt.
"""
from __future__ import annotations

import json
import sysconfig
from importlib import metadata
from pathlib import Path

import torch

from forerun.errors import ConfigError

TEXT_SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt"}
JSONL_FIELDS = ("text", "content", "prompt", "completion", "response")
MAX_FILE_BYTES = 1_000_000  # larger source / doc files are mostly data tables, not text (JSONL: any size)


def source_files(spec: str) -> list[Path]:
    """The files one --data entry names, sorted: a file, a folder (its text files,
    recursively) or pkg:NAME (the distribution's text files)."""
    if spec.startswith("pkg:"):
        try:
            dist = metadata.distribution(spec[4:])
        except metadata.PackageNotFoundError:
            raise ConfigError(f"--data {spec}: no installed package named {spec[4:]!r}") from None
        files = [Path(dist.locate_file(f)) for f in dist.files or []]
        return sorted(p for p in files if p.suffix in TEXT_SUFFIXES and p.is_file())
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.suffix == ".jsonl"))
    if path.is_file():
        return [path]
    raise ConfigError(f"--data {spec}: no such file, folder or pkg:NAME")


def check_allowed(path: Path) -> None:
    """Refuse benchmark prompts and the standard library (see the module docstring)."""
    from forerun.prompts import data_dir

    p = path.resolve()
    if p.is_relative_to(data_dir().resolve()):
        raise ConfigError(f"--data {path}: the benchmark prompt sets ({data_dir()}) must not be trained on")
    paths = sysconfig.get_paths()
    stdlib = [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib")]
    packages = [Path(paths[k]).resolve() for k in ("purelib", "platlib")]
    if any(p.is_relative_to(s) for s in stdlib) and not any(p.is_relative_to(s) for s in packages):
        raise ConfigError(f"--data {path}: Python's standard library is excluded from training data")


def read_texts(path: Path) -> list[str]:
    """A file's texts: one per JSONL row (its first text field, or its `turns`), else the file
    (none for a source or doc file over MAX_FILE_BYTES; a JSONL file is data, read whatever its size)."""
    if path.suffix != ".jsonl" and path.stat().st_size > MAX_FILE_BYTES:
        return []
    raw = path.read_text(encoding="utf-8", errors="ignore")
    if path.suffix != ".jsonl":
        return [raw] if raw.strip() else []
    texts = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: not JSON lines ({line[:60]!r})") from None
        if isinstance(row, str):
            texts.append(row)
        elif isinstance(row, dict):
            turns = row.get("turns")
            texts += [str(row[k]) for k in JSONL_FIELDS if isinstance(row.get(k), str)][:1]
            texts += [t for t in turns if isinstance(t, str)] if isinstance(turns, list) else []
    return [t for t in texts if t.strip()]


def token_chunks(specs: list[str], encode, eos: int, seq_len: int, max_tokens: int, seed: int) -> torch.Tensor:
    """[n, seq_len] int64: texts of the sources' files (in a seeded shuffle), each followed
    by eos, concatenated and cut into whole chunks; reading stops after max_tokens tokens."""
    files = [p for spec in specs for p in source_files(spec)]
    for p in files:
        check_allowed(p)
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    ids: list[int] = []
    for i in order:
        for text in read_texts(files[i]):
            ids += encode(text) + [eos]
            if len(ids) >= max_tokens:
                return _cut(ids[:max_tokens], seq_len)
    return _cut(ids, seq_len)


def _cut(ids: list[int], seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    if n == 0:
        raise ConfigError(f"the training data holds {len(ids)} tokens, fewer than one chunk of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split(chunks: torch.Tensor, eval_chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out): a seeded shuffle of the chunks, the last eval_chunks held out."""
    if chunks.shape[0] <= eval_chunks:
        raise ConfigError(f"{chunks.shape[0]} chunks of data: need more than --eval-chunks {eval_chunks}")
    order = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(seed))
    return chunks[order[:-eval_chunks]], chunks[order[-eval_chunks:]]
