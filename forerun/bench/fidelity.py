"""What `forerun quality` measured, kept so that every speed forerun prints carries its
precision's fidelity (`generate`, `cost`, `bench`, `eval`, `serve`): a speed of int4 or gguf
without how far that precision moves the model from float32 is half a result.

One record per model weights, in the cache (FORERUN_CACHE_DIR/quality/<key>.json):

    {"model": name, "weights": {"files": [[path, size, mtime_ns], ...]},
     "rows": {label or "llama.cpp": {"ppl", "ppl_vs_float32", "kl", "top1", "tokens",
                                     "text", "ctx", "chunks", "measured", "kernels"}}}

A row's label is its dtype, or with a float16 KV cache "<dtype> kv=float16" (label_of): a
16-bit cache moves the logits too, so it is a fidelity of its own.

The key is the weights' identity, not the folder's: a converted GGUF folder is keyed by its GGUF
file (the float32 copy written into that folder on first use changes nothing), an HF folder by
its weight files. A row also keeps the digest of the kernel sources it was computed with
("kernels"): int8 / int4 / gguf compute in those kernels, so such a row from other sources is
shown as stale, with the command that measures it again. Nothing here measures: a precision with no
record gets the command that measures it.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import shlex
from pathlib import Path

from forerun.cache import cache_dir, write_atomic
from forerun.kernels import build_key

RECORD_DIR = "quality"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
KERNEL_DTYPES = ("gguf", "int8", "int4")  # computed by forerun's kernels (float32 and bfloat16: by torch)


def label_of(dtype: str, kv_cache: str = "auto") -> str:
    """A quality row's label: the dtype, and a float16 KV cache where it has one.

    >>> label_of("gguf"), label_of("gguf", "float32"), label_of("gguf", "float16")
    ('gguf', 'gguf', 'gguf kv=float16')
    """
    return f"{dtype} kv=float16" if kv_cache == "float16" else dtype


def weights_of(source: Path) -> list[Path]:
    """The files a model's weights come from: a converted folder's GGUF, else the folder's
    weight files (sorted); [] when there are none (a folder built in memory)."""
    from forerun.gguf.convert import source_of

    gguf = source_of(source)
    if gguf is not None:
        return [gguf.resolve()]
    return sorted(p.resolve() for p in source.iterdir() if p.suffix in WEIGHT_SUFFIXES) if source.is_dir() else []


def kernels_digest() -> str:
    """The digest of the kernel sources beside this forerun (build_key: names and bytes)."""
    return build_key.sources_digest(build_key.read_sources(build_key.key_files(build_key.sources())))


def weights_ident(source: Path) -> list[list]:
    """[[path, size, mtime_ns], ...] of weights_of(source): what the record is keyed by."""
    return [[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in weights_of(source)]


def record_path(source: Path) -> Path | None:
    """Where the record of this model's weights lives; None when they have no files."""
    return path_of(weights_ident(source))


def path_of(ident: list[list]) -> Path | None:
    """record_path for a weights_ident already taken."""
    if not ident:
        return None
    return cache_dir() / RECORD_DIR / f"{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]}.json"


def rows_at(path: Path | None) -> dict:
    """A record file's rows by label ({} when there is none or it cannot be read)."""
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def load(source: Path | None) -> dict:
    """The rows of the record of `source`'s weights ({} when there is none)."""
    return rows_at(record_path(source)) if source is not None else {}


def save(source: Path, name: str, rows, text: str, ctx: int, chunks: int) -> Path | None:
    """Add `forerun quality`'s rows (QualityRow: label, ppl, tokens, ppl_vs_ref, kl, top1) to the
    model's record, replacing older rows of the same labels. Returns the file (None: no weights)."""
    ident = weights_ident(source)  # (stat the weights once: the key, and what the record says it is of)
    path = path_of(ident)
    if path is None:
        return None
    kept = rows_at(path)
    day, kernels = datetime.date.today().isoformat(), kernels_digest()
    for r in rows:
        label = "llama.cpp" if r.label.startswith("llama.cpp") else r.label
        kept[label] = {"ppl": r.ppl, "ppl_vs_float32": r.ppl_vs_ref, "kl": r.kl, "top1": r.top1, "tokens": r.tokens,
                       "text": text, "ctx": ctx, "chunks": chunks, "measured": day, "kernels": kernels}
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": name, "weights": {"files": ident}, "rows": kept}
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))
    return path


def describe(rows: dict, dtype: str, model_arg: str | None, kernels: str | None = None, kv_cache: str = "auto") -> str:
    """One line for a speed figure of `dtype` (with its KV cache's dtype): its measured fidelity,
    or how to measure it (again, when the row was computed by kernel sources other than `kernels`).

    >>> describe({"int4": {"ppl_vs_float32": 1.0, "kl": 0.0084, "top1": 0.971, "tokens": 1530,
    ...           "text": "argparse, difflib, textwrap", "measured": "2026-12-04"}}, "int4", "m")
    'fidelity of int4: perplexity +1.00% vs float32, mean KL 0.0084, top-1 agreement 97.1% (forerun quality, 1530 tokens of argparse, difflib, textwrap, 2026-12-04)'
    >>> describe({}, "float32", "m")
    'fidelity of float32: the reference (the weights as stored, dequantized exactly; `forerun quality` measures the other precisions against it)'
    >>> describe({}, "gguf", "m")
    'fidelity of gguf: not measured for this model yet: `forerun quality --model m --dtype gguf` (perplexity, KL and top-1 agreement against float32)'
    >>> describe({"gguf": {"kernels": "a", "measured": "2026-12-01"}}, "gguf", "m", kernels="b")
    'fidelity of gguf: measured 2026-12-01 by other kernels than these; measure it again: `forerun quality --model m --dtype gguf`'
    >>> describe({}, "float32", "m", kv_cache="float16")
    'fidelity of float32 kv=float16: not measured for this model yet: `forerun quality --model m --dtype float32 --kv-cache-dtype float16` (perplexity, KL and top-1 agreement against float32)'
    """
    label = label_of(dtype, kv_cache)
    if label == "float32":
        return ("fidelity of float32: the reference (the weights as stored, dequantized exactly; `forerun quality` "
                "measures the other precisions against it)")
    kv_flag = " --kv-cache-dtype float16" if label != dtype else ""
    r, measure = rows.get(label), f"`forerun quality --model {shlex.quote(str(model_arg))} --dtype {dtype}{kv_flag}`"
    if r is None:
        return (f"fidelity of {label}: not measured for this model yet: {measure} (perplexity, KL and top-1 "
                "agreement against float32)")
    if kernels is not None and (dtype in KERNEL_DTYPES or label != dtype) and r.get("kernels") != kernels:
        return f"fidelity of {label}: measured {r.get('measured')} by other kernels than these; measure it again: {measure}"
    return (f"fidelity of {label}: perplexity {r['ppl_vs_float32']:+.2f}% vs float32, mean KL {r['kl']:.4f}, top-1 "
            f"agreement {r['top1']:.1%} (forerun quality, {r['tokens']} tokens of {r['text']}, {r['measured']})")


def line_for(llm, model_arg: str | None) -> str:
    """describe() for an LLM as loaded (its resolved precision and KV cache, its weights' record)."""
    return describe(load(llm.source), llm.dtype, model_arg or "smollm2-135m", kernels_digest(), llm.precision.kv_cache)
