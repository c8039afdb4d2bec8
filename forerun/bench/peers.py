"""Peers beside forerun in a bench report: Hugging Face transformers' `generate` (plain,
prompt lookup, an assistant model, and its self-speculative early exit, where the first N
layers under the model's own head draft: `assistant_early_exit=N`) on the same weights and
prompts, each with how many outputs equal forerun's plain decoding; and llama.cpp's own
tools on the model's GGUF (llama-bench: plain decoding; llama-speculative-simple: its
prompt lookup and, given a draft GGUF, draft-model speculation).

Each peer that cannot run here is skipped with a sentence saying why and how to get it.
transformers figures are end to end (prefill included) like forerun's, engines rotating
per prompt; llama.cpp's are decode-only tokens/s from its own timers, set beside
forerun's decode-only figure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forerun.config import SamplingParams

LLAMA_ENV = "FORERUN_LLAMA_CPP_BIN"
LLAMA_HOWTO = ("llama.cpp tools not found: pass --llama-cpp-dir or set $FORERUN_LLAMA_CPP_BIN to the folder holding "
               "llama-bench and llama-speculative-simple (build them from the llama.cpp sources inside the "
               "llama-cpp-python sdist: pip download --no-binary :all: --no-deps llama-cpp-python; tar xf it; "
               "cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF && cmake --build build -j --target "
               "llama-bench llama-speculative-simple; about 15 minutes on 2 cores)")


@dataclass
class PeerSetup:
    prompts: list[list[int]]  # token ids, the same for every engine
    texts: list[str]  # the same prompts as text (for llama.cpp's command line)
    max_new: int
    k: int  # draft length for the peers' speculation
    draft_source: Path | None = None  # an HF folder for transformers' assistant_model
    gguf: Path | None = None  # the verifier's GGUF for llama.cpp
    draft_gguf: Path | None = None
    llama_dir: str | None = None
    exit_layer: int | None = None  # transformers' assistant_early_exit (None: half the layers)
    threads: int = field(default_factory=torch.get_num_threads)


def run_peers(verifier, vs: list[str], setup: PeerSetup, methods=()) -> dict:
    """{"rows": [...], "skipped": [...]}: forerun plain and each of its `methods` (bench
    Methods) on the peers' prompts, then each peer asked for."""
    rows, skipped = [], []
    ref = _forerun(verifier, None, "forerun plain", setup)
    rows.append(ref)
    for m in methods:
        row = _forerun(m.llm, m.spec, f"forerun {m.label}", setup)
        row.update(vs_forerun_plain=row["tokens_per_s"] / ref["tokens_per_s"],
                   same_tokens=f"{sum(a == b for a, b in zip(row.pop('tokens'), ref['tokens']))}/{len(setup.prompts)}")
        rows.append(row)
    if "transformers" in vs:
        try:
            rows += _transformers(verifier, setup, ref)
        except (ImportError, OSError, ValueError) as e:
            skipped.append(f"transformers: {e.__class__.__name__}: {e} (pip install 'forerun[test]')")
    if "llama.cpp" in vs:
        rows_l, why = _llama_cpp(setup, ref)
        rows += rows_l
        skipped += why
    ref.pop("tokens")
    return {"rows": rows, "skipped": skipped, "n_prompts": len(setup.prompts), "max_new_tokens": setup.max_new}


def _forerun(llm, spec, name: str, setup: PeerSetup) -> dict:
    params = SamplingParams(temperature=0, max_tokens=setup.max_new)
    outs = [llm.generate([ids], params, speculative=spec)[0] for ids in setup.prompts]
    n, t = sum(o.stats.generated for o in outs), sum(o.stats.wall_time for o in outs)
    decode = sum(o.stats.decode_time for o in outs)
    return {"engine": name, "tokens_per_s": n / t, "decode_tokens_per_s": n / decode, "vs_forerun_plain": 1.0,
            "tokens": [o.token_ids for o in outs], "same_tokens": f"{len(outs)}/{len(outs)}",
            "note": f"end to end ({n / decode:.1f} tok/s decode only)"}


def _transformers(verifier, setup: PeerSetup, ref: dict) -> list[dict]:
    import transformers

    if verifier.source is None:
        raise ValueError("the verifier was built in memory: transformers needs a model folder")
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()  # noqa: E731
    hf = load(verifier.source)
    eos = sorted(verifier.eos_ids())
    engines = {"transformers plain": {}, f"transformers prompt lookup ({setup.k})": {"prompt_lookup_num_tokens": setup.k}}
    if setup.draft_source is not None:
        engines["transformers assistant model"] = {"assistant_model": load(setup.draft_source)}
    exit_layer = setup.exit_layer or max(1, hf.config.num_hidden_layers // 2)
    engines[f"transformers early exit ({exit_layer} of {hf.config.num_hidden_layers} layers)"] = {"assistant_early_exit": exit_layer}
    totals = {name: [0, 0.0, 0] for name in engines}
    names = list(engines)
    for name in names:  # untimed: first-call costs land on no engine
        _hf_generate(hf, setup.prompts[0], 4, eos, engines[name])
    for i, ids in enumerate(setup.prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            toks, dt = _hf_generate(hf, ids, setup.max_new, eos, engines[name])
            totals[name][0] += len(toks)
            totals[name][1] += dt
            totals[name][2] += toks == ref["tokens"][i]
    n = len(setup.prompts)
    return [{"engine": name, "tokens_per_s": tok / dt, "vs_forerun_plain": (tok / dt) / ref["tokens_per_s"],
             "same_tokens": f"{same}/{n}", "note": "end to end, float32"} for name, (tok, dt, same) in totals.items()]


def _hf_generate(model, ids, max_new, eos, extra) -> tuple[list[int], float]:
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0], **extra)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def llama_cpp_dir(given: str | None) -> Path | None:
    d = given or os.environ.get(LLAMA_ENV)
    if d and (Path(d) / "llama-bench").is_file():
        return Path(d)
    return None


def _llama_cpp(setup: PeerSetup, ref: dict) -> tuple[list[dict], list[str]]:
    bindir = llama_cpp_dir(setup.llama_dir)
    if bindir is None:
        return [], [LLAMA_HOWTO]
    if setup.gguf is None:
        return [], ["llama.cpp: no GGUF file for this model (use an embedded model or a .gguf --model)"]
    base = ref["decode_tokens_per_s"]
    depth = mean_depth(setup.prompts)
    rows = [{**_row("llama.cpp plain (llama-bench)", _llama_bench(bindir, setup, depth), base),
             "note": f"decode only after {depth} tokens of context (the prompts' mean), {setup.gguf.name} "
                     "(its own quantisation)"}]
    runs = {"llama.cpp prompt lookup (ngram-simple)": ["--spec-type", "ngram-simple"]}
    if setup.draft_gguf is not None:
        runs["llama.cpp draft model"] = ["--spec-type", "draft-simple", "-md", str(setup.draft_gguf)]
    skipped = [] if setup.draft_gguf else ["llama.cpp draft model: pass --draft-gguf to run llama-speculative-simple with a drafter"]
    for name, extra in runs.items():
        tps, acc = _llama_spec(bindir, setup, extra)
        rows.append({**_row(name, tps, base), "note": f"decode only, acceptance {acc}"})
    return rows, skipped


def _row(name: str, tps: float | None, base: float) -> dict:
    return {"engine": name, "tokens_per_s": tps, "vs_forerun_plain": tps / base if tps else None,
            "note": "decode only (vs forerun's decode-only tok/s)"}


def mean_depth(prompts: list[list[int]]) -> int:
    """The context, in tokens, that llama-bench should decode after to stand beside forerun's
    decoding of these prompts: their mean length. Each decoded token reads every cached key and
    value, a cost linear in the context, so the mean context gives the mean cost per token; at
    2048 tokens llama.cpp decodes the 1.5B a third slower than at none (docs/results.md).
    >>> mean_depth([[1] * 100, [1] * 301]), mean_depth([])
    (200, 0)
    """
    return round(sum(len(p) for p in prompts) / len(prompts)) if prompts else 0


def llama_bench_cmd(bindir: Path, gguf, new_tokens: int, threads: int, depth: int = 0, repetitions: int = 3) -> list[str]:
    """llama-bench timing plain decoding of `new_tokens` tokens after `depth` tokens of context
    (its -d: the context is read first, untimed), JSON out. -d only when depth > 0, so builds
    older than the option still run at depth 0.
    >>> llama_bench_cmd(Path("/b"), "m.gguf", 128, 2, depth=300, repetitions=1)[3:12]
    ['-p', '0', '-n', '128', '-t', '2', '-r', '1', '-o']
    >>> llama_bench_cmd(Path("/b"), "m.gguf", 128, 2, depth=300)[-2:], "-d" in llama_bench_cmd(Path("/b"), "m", 8, 2)
    (['-d', '300'], False)
    """
    cmd = [str(bindir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]
    return cmd + (["-d", str(depth)] if depth > 0 else [])


def _llama_bench(bindir: Path, setup: PeerSetup, depth: int) -> float | None:
    cmd = llama_bench_cmd(bindir, setup.gguf, setup.max_new, setup.threads, depth)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    rows = json.loads(out or "[]")
    return float(rows[0]["avg_ts"]) if rows else None


def _llama_spec(bindir: Path, setup: PeerSetup, extra: list[str]) -> tuple[float | None, str]:
    """Summed decode tokens / seconds over the prompts, from llama-speculative-simple's log."""
    tokens, seconds, acc = 0, 0.0, []
    for text in setup.texts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        cmd = [str(bindir / "llama-speculative-simple"), "-m", str(setup.gguf), "-f", f.name, "-n", str(setup.max_new),
               "--spec-draft-n-max", str(setup.k), "-t", str(setup.threads), "--temp", "0", *extra]
        log = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stderr
        os.unlink(f.name)
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if m:
            tokens, seconds = tokens + int(m.group(1)), seconds + float(m.group(2))
        a = re.search(r"accept\s+=\s+([\d.]+)%", log)  # "-nan%" when nothing was drafted
        if a:
            acc.append(float(a.group(1)))
    return (tokens / seconds if seconds > 0 else None), (f"{sum(acc) / len(acc):.0f}%" if acc else "n/a")
