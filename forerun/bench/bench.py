"""`forerun bench`: workloads x (plain + methods), one process, one JSON that grows.

The JSON (`OUT/bench.json`) is written after every workload, so an interrupted run keeps
what it finished and `--resume` skips the cells (workload, method label) already there;
a resumed workload re-measures plain decoding beside the methods it still runs, so every
cell's speedup is against plain runs interleaved with its own. A method whose drafter
cannot run on this verifier is left out with a warning saying why.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from forerun.bench.cell import summarize_cell
from forerun.bench.grid import Method, Workload, refuse, run_workload, warm_up
from forerun.config import SamplingParams
from forerun.errors import ForerunError
from forerun.llm import LLM
from forerun.prompts import SPEC_BENCH_SUBTASKS, Prompt, load_prompts
from forerun.bench.provenance import Sample, token_pieces

SAMPLE_TOKENS = 96  # tokens of each cell's first output kept for the coloured samples


@dataclass
class BenchRun:
    verifier: LLM
    methods: list[Method]
    workloads: list[Workload]
    params: SamplingParams
    meta: dict  # model, dtype, prompts, limit ...: must match a resumed JSON's
    out: Path
    resume: bool = False
    progress: bool = True
    result: dict = field(default_factory=dict)

    @property
    def json_path(self) -> Path:
        return self.out / "bench.json"


def prompt_ids(llm: LLM, prompt: Prompt) -> list[int]:
    """The prompt's token ids as fed to the model: a chat prompt through the chat template."""
    text = llm.apply_chat_template([{"role": "user", "content": prompt.text}]) if prompt.chat else prompt.text
    return llm.encode([text])[0]


def workloads_from(llm: LLM, sets: list[str], limit: int, data_dir=None, turns: int = 1) -> list[Workload]:
    """Each `spec_bench:<subtask>` is one workload, and `spec_bench` is its six subtasks;
    other sets (and JSONL files) are split by their prompts' category. `limit`: prompts per
    workload; `turns`: a prompt with several user turns (MT-Bench's two) plays up to that
    many as a session."""
    sets = [s for name in sets for s in ([f"spec_bench:{t}" for t in SPEC_BENCH_SUBTASKS] if name == "spec_bench" else [name])]
    groups: dict[str, list[Prompt]] = {}
    for name in sets:
        prompts = load_prompts(name, data_dir=data_dir)
        sub = name.partition(":")[2] if name.startswith("spec_bench:") else None
        for p in prompts:
            groups.setdefault(sub or p.category, []).append(p)
    return [Workload(cat, [(p.id, prompt_ids(llm, p)) for p in ps[:limit]],
                     {p.id: p.turns[:turns] for p in ps[:limit] if turns > 1 and len(p.turns) > 1})
            for cat, ps in groups.items()]


def load_previous(run: BenchRun) -> dict:
    """The JSON to extend: empty unless --resume finds one made with the same settings."""
    if not (run.resume and run.json_path.is_file()):
        return {"meta": run.meta, "cells": [], "samples": [], "warnings": []}
    old = json.loads(run.json_path.read_text())
    if old.get("meta") != run.meta:
        diff = sorted(k for k in set(old.get("meta", {})) | set(run.meta) if old["meta"].get(k) != run.meta.get(k))
        raise ForerunError(f"--resume: {run.json_path} was made with other settings ({', '.join(diff)}); "
                           "use another --out or drop --resume")
    return old


def run_bench(run: BenchRun) -> dict:
    """Run every pending cell, saving the JSON after each workload; returns the result."""
    from tqdm import tqdm

    result = run.result = load_previous(run)
    todo = _pending(run, result)
    total = sum(sum(max(1, len(w.sessions.get(pid, ()))) for pid, _ in w.prompts) * (len(ms) + 1) for w, ms in todo)
    with tqdm(total=total, desc="bench runs", disable=not run.progress, unit="run") as bar:
        for w, ms in todo:
            bar.set_postfix_str(w.category)
            pairs = run_workload(run.verifier, ms, w, run.params, tick=bar.update)
            for m in ms:
                result["cells"].append(summarize_cell(w.category, m.label, m.k, pairs[m.label], run.params.greedy))
                result["samples"].append(_sample(run.verifier, w.category, m.label, pairs[m.label][0]))
            save(result, run.json_path)
    return result


def _pending(run: BenchRun, result: dict) -> list[tuple[Workload, list[Method]]]:
    """(workload, methods) still to run, warmed up; methods that cannot run on this
    verifier are left out with a warning (all of them: the error)."""
    done = {(c["category"], c["method"]) for c in result["cells"]}
    todo = [(w, [m for m in run.methods if (w.category, m.label) not in done]) for w in run.workloads]
    todo = [(w, ms) for w, ms in todo if ms]
    if not todo:
        return []
    run.out.mkdir(parents=True, exist_ok=True)
    pending = {m.label: m for _, ms in todo for m in ms}
    failed = warm_up(run.verifier, list(pending.values()), todo[0][0].prompts[0][1])
    if len(failed) == len(pending):
        refuse(failed)
    for label, why in failed.items():
        note = f"{label} left out: {why}"
        print(f"forerun: {note}", file=sys.stderr, flush=True)
        result["warnings"] += [] if note in result["warnings"] else [note]
    todo = [(w, [m for m in ms if m.label not in failed]) for w, ms in todo]
    return [(w, ms) for w, ms in todo if ms]


def _sample(llm: LLM, category: str, label: str, pair) -> dict:
    n = min(SAMPLE_TOKENS, len(pair.spec_tokens))
    pieces = token_pieces(llm.decode, pair.spec_tokens[:n]) if llm.tokenizer is not None else [
        f"[{t}]" for t in pair.spec_tokens[:n]]
    s = Sample(f"{category} / {label} / {pair.prompt_id}", pieces, pair.spec.origins[:n])
    return {"category": category, "method": label, **s.to_dict()}


def save(result: dict, path: Path):
    """Write atomically: an interruption never leaves half a JSON."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
