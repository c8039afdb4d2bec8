"""What a GGUF file holds where: its architecture and each tensor's name, type, shape and bytes.

Why: gguf's GGUFReader parses every metadata field on opening, the tokenizer's 150K strings
included, one numpy view each: 4-10 s for a Qwen2.5 file on this 2-core machine, and loading a
model at gguf / int8 / int4 opened it twice (the dtype choice, then the blocks). The index is
read with GGUFReader once per file version and kept as JSON in the cache, keyed by the file's
path, size and modification time and checked against a hash of the file's header (its first few
MB); from then on a load reads only those and the tensor bytes it needs.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

INDEX_VERSION = 2


@dataclass(frozen=True)
class TensorEntry:
    name: str  # llama.cpp's name, e.g. blk.0.attn_q.weight
    type: int  # ggml type id (gguf.GGMLQuantizationType)
    dims: tuple[int, ...]  # GGUF's order, fastest-varying first ([K, rows] for a matrix)
    offset: int  # of its data, from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str | None  # general.architecture
    tensors: tuple[TensorEntry, ...]  # in the file's order
    header_sha1: str  # of the bytes before the first tensor's data (checked on every read from the cache)


def gguf_index(path: Path, reader=None) -> GGUFIndex:
    """The index of the GGUF at `path`: from the cache when the file is the one indexed there,
    else read with GGUFReader (unreadable files raise ModelLoadError; `reader`: one already open
    on it) and cached."""
    from forerun.errors import ModelLoadError

    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _MEMO:
        return _MEMO[key]
    stored = _stored(*key)
    index = None
    if reader is None:
        try:
            index = _decode(json.loads(stored.read_text()))
            if index.header_sha1 != _header_sha1(path, index.tensors):  # rewritten, size and time kept
                index = None
        except (OSError, ValueError, KeyError, TypeError):
            index = None
    if index is None:
        index = _read(path, reader)
        _write(stored, index)
    _MEMO[key] = index
    return index


def _header_sha1(path: Path, tensors: tuple[TensorEntry, ...]) -> str:
    """SHA-1 of the file's bytes before its first tensor's data: metadata and tensor table (a few
    MB, read in milliseconds), so an index is never used for another file of the same size and time."""
    end = min((t.offset for t in tensors), default=0)
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        while end > 0:
            chunk = f.read(min(end, 1 << 22))
            if not chunk:
                break
            digest.update(chunk)
            end -= len(chunk)
    return digest.hexdigest()


_MEMO: dict[tuple[str, int, int], GGUFIndex] = {}  # this process's indexes, by (path, size, mtime)


def _stored(path: str, size: int, mtime_ns: int) -> Path:
    from forerun.cache import cache_dir

    key = hashlib.sha1(f"{path}:{size}:{mtime_ns}:{INDEX_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf_index" / f"{Path(path).stem}-{key}.json"


def _write(stored: Path, index: GGUFIndex) -> None:
    """Written beside, then renamed: a reader never sees half of it. A read-only cache only
    means the index is read from the file again next time."""
    scratch = stored.with_name(f".{stored.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        scratch.write_text(json.dumps(_encode(index)))
        os.replace(scratch, stored)
    except OSError:
        pass
    finally:
        scratch.unlink(missing_ok=True)


def _read(path: Path, reader=None) -> GGUFIndex:
    reader = reader if reader is not None else open_reader(path)
    arch = reader.fields.get("general.architecture")
    tensors = tuple(TensorEntry(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset),
                                int(t.n_bytes)) for t in reader.tensors)
    return GGUFIndex(None if arch is None else str(arch.contents()), tensors, _header_sha1(path, tensors))


def open_reader(path: Path):
    """gguf's GGUFReader on `path`; a missing or unreadable file raises ModelLoadError."""
    from gguf import GGUFReader

    from forerun.errors import ModelLoadError

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:  # bad magic, truncation and garbage surface as assorted numpy/struct errors
        raise ModelLoadError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None


def _encode(index: GGUFIndex) -> dict:
    return {"architecture": index.architecture, "header_sha1": index.header_sha1,
            "tensors": [[t.name, t.type, list(t.dims), t.offset, t.nbytes] for t in index.tensors]}


def _decode(data: dict) -> GGUFIndex:
    tensors = tuple(TensorEntry(str(n), int(ty), tuple(int(d) for d in dims), int(off), int(nb))
                    for n, ty, dims, off, nb in data["tensors"])
    return GGUFIndex(data["architecture"], tensors, str(data["header_sha1"]))
