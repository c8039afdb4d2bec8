"""`forerun quality`: how far each precision moves a model from float32, on a text.

Per dtype: perplexity, the mean KL(float32 || dtype) per scored token and top-1 agreement
with float32 at the same positions. Perplexity follows llama.cpp's `llama-perplexity`
(tools/perplexity, `perplexity()`), so its estimate on the model's GGUF sits beside ours:

    ids     = tokenize(text), with BOS when the tokenizer adds one
    chunk i = ids[i * ctx : (i + 1) * ctx] for i < min(chunks, len(ids) // ctx); its first
              token is overwritten by BOS when the tokenizer adds one (llama.cpp does so)
    each chunk runs alone from an empty cache; the logits at positions ctx/2 .. ctx-2
    score the tokens at ctx/2 + 1 .. ctx-1: ctx - 1 - ctx/2 tokens a chunk
    PPL     = exp(mean NLL over every scored token)

Worked example, ctx = 8: positions 4, 5, 6 score tokens 5, 6, 7 (3 a chunk). llama.cpp
refuses texts shorter than 2 * ctx tokens; so do we, so that both always score the same
chunks. A chunk is one forward of the model over `chain_batch` on a fresh `KVCache`, the
forward the engine's prefill and steps make.
"""
from __future__ import annotations

import importlib
import inspect
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from forerun.errors import ForerunError
from forerun.kv.cache import chain_batch

DEFAULT_SOURCES = ("argparse", "difflib", "textwrap")  # standard-library modules whose source is the default text


def default_text() -> tuple[str, list[str]]:
    """(the concatenated sources of DEFAULT_SOURCES, their paths), read from this Python."""
    paths = [inspect.getsourcefile(importlib.import_module(name)) for name in DEFAULT_SOURCES]
    return "\n".join(Path(p).read_text(encoding="utf-8") for p in paths), paths


# --- the math (pure) ---------------------------------------------------------------------------


def scored_span(ctx: int) -> range:
    """Positions of a ctx-token chunk whose logits are scored (each against the next token).

    >>> list(scored_span(8))
    [4, 5, 6]
    """
    return range(ctx // 2, ctx - 1)


def make_chunks(ids: list[int], ctx: int, chunks: int, bos: int | None = None) -> list[list[int]]:
    """The first min(chunks, len(ids) // ctx) ctx-token chunks, BOS over each first token.

    >>> make_chunks(list(range(10, 20)), 4, 5, bos=1)
    [[1, 11, 12, 13], [1, 15, 16, 17]]
    """
    out = [ids[i * ctx : (i + 1) * ctx] for i in range(min(chunks, len(ids) // ctx))]
    return [[bos, *c[1:]] for c in out] if bos is not None else out


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per row: logprobs [N, V], targets [N] -> [N]."""
    return -logprobs.gather(-1, targets[:, None]).squeeze(-1)


def kl_divergence(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row in nats from log-probs ref = log P, other = log Q: [N, V] -> [N].
    Terms where P is 0 are 0 (log P = -inf included), as in the definition."""
    p = ref.exp()
    return torch.where(p > 0, p * (ref - other), 0.0).sum(-1)


def top1_agreement(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Whether each row's most likely token is the same: [N, V] x 2 -> [N] bool."""
    return ref.argmax(-1) == other.argmax(-1)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean NLL). Uniform logits over V tokens give V."""
    return math.exp(nll_sum / tokens)


@dataclass
class Tally:
    """Sums over the scored tokens of one precision, chunk after chunk."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0

    def add(self, ref: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor):
        """ref, logprobs: [N, V] log-probs (float32's, this precision's); targets [N]."""
        self.nll += token_nll(logprobs, targets).double().sum().item()
        self.kl += kl_divergence(ref, logprobs).double().sum().item()
        self.agree += int(top1_agreement(ref, logprobs).sum().item())
        self.tokens += len(targets)


@dataclass
class QualityRow:
    label: str  # a dtype, or "llama.cpp (<gguf name>)"
    ppl: float
    tokens: int  # scored tokens
    ppl_vs_ref: float  # (ppl / float32's ppl - 1) * 100
    kl: float | None = None  # mean KL(float32 || this) per scored token, nats; None: not comparable (llama.cpp)
    top1: float | None = None  # fraction of scored positions whose argmax is float32's

    @classmethod
    def from_tally(cls, label: str, t: Tally, ref_ppl: float) -> QualityRow:
        ppl = perplexity(t.nll, t.tokens)
        return cls(label, ppl, t.tokens, (ppl / ref_ppl - 1) * 100, t.kl / t.tokens, t.agree / t.tokens)


# --- scoring models ----------------------------------------------------------------------------


@torch.inference_mode()
def chunk_logprobs(model, chunk: list[int]) -> torch.Tensor:
    """Log-softmax of the model's logits at the chunk's scored positions: [len(scored_span), V]
    float32, from one forward over the chunk on an empty cache."""
    span = scored_span(len(chunk))
    at = torch.arange(span.start, span.stop, device=model.device)[None]  # [1, N]
    out = model(chain_batch([chunk], [0], [0], model.device), model.new_cache(1, len(chunk)), logits_at=at)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def evaluate(models: dict[str, torch.nn.Module | Callable[[], torch.nn.Module]], chunks: list[list[int]],
             progress: Callable[[], None] | None = None) -> list[QualityRow]:
    """One row per model (label -> model, or a function that loads it; the first is the float32
    reference, its row KL 0 and agreement 1). Precision after precision: a loader's model is
    loaded when its turn comes and dropped after its chunks, so one model besides the
    reference is in memory at a time (the 1.5B's float32, int8 and int4 together outgrow 24 GB);
    the reference's log-probs of the scored positions are kept meanwhile ([N, V] float32 a chunk)."""
    if not chunks:
        raise ForerunError("no chunk to score")
    labels = list(models)
    ref_model = _model(models[labels[0]])
    refs = []
    tallies = {label: Tally() for label in labels}
    for chunk in chunks:
        refs.append(chunk_logprobs(ref_model, chunk))
        tallies[labels[0]].add(refs[-1], refs[-1], _targets(chunk, refs[-1].device))
        if progress is not None:
            progress()
    for label in labels[1:]:
        model = _model(models[label])
        for chunk, ref in zip(chunks, refs):
            tallies[label].add(ref, chunk_logprobs(model, chunk).to(ref.device), _targets(chunk, ref.device))
            if progress is not None:
                progress()
        del model
    ref_ppl = perplexity(tallies[labels[0]].nll, tallies[labels[0]].tokens)
    return [QualityRow.from_tally(label, t, ref_ppl) for label, t in tallies.items()]


def _model(entry):
    return entry if isinstance(entry, torch.nn.Module) else entry()


def _targets(chunk: list[int], device) -> torch.Tensor:
    """The tokens the scored positions predict."""
    return torch.tensor(chunk[scored_span(len(chunk)).start + 1 :], device=device)


# --- llama.cpp ---------------------------------------------------------------------------------


def parse_llama_log(log: str) -> tuple[float | None, int | None]:
    """(the final estimate, the chunks scored) from llama-perplexity's log, None where absent:
    "calculating perplexity over 2 chunks, n_ctx=512, ..." ... "Final estimate: PPL = 12.3456 +/- 0.12345"."""
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"perplexity over (\d+) chunks", log)
    return (float(ppl.group(1)) if ppl else None), (int(chunks.group(1)) if chunks else None)


@dataclass(frozen=True)
class LlamaRun:
    bindir: Path  # holds llama-perplexity
    gguf: Path
    threads: int


def llama_perplexity(run: LlamaRun, text: str, ctx: int, chunks: int) -> tuple[float, int]:
    """(PPL, scored tokens) of llama-perplexity on run.gguf over `text` (written to a temp file),
    with our ctx and chunks."""
    exe = run.bindir / "llama-perplexity"
    if not exe.is_file():
        raise ForerunError(f"no llama-perplexity in {run.bindir} (build it: cmake --build BUILD --target llama-perplexity)")
    with tempfile.TemporaryDirectory(prefix="forerun-quality-") as scratch:
        path = Path(scratch) / "text.txt"
        path.write_text(text, encoding="utf-8")
        cmd = [str(exe), "-m", str(run.gguf), "-f", str(path), "-c", str(ctx), "--chunks", str(chunks), "-t", str(run.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    log = done.stdout + done.stderr
    ppl, used = parse_llama_log(log)
    if ppl is None:
        tail = "\n".join(log.strip().splitlines()[-5:])
        raise ForerunError(f"llama-perplexity gave no final estimate (exit {done.returncode}); its last lines:\n{tail}")
    return ppl, (used or chunks) * len(scored_span(ctx))


# --- output ------------------------------------------------------------------------------------


def markdown_table(rows: list[QualityRow], ref_label: str = "float32") -> str:
    """The rows as a Markdown table; "n/a" where a figure does not apply (llama.cpp's KL)."""
    lines = [f"| precision | PPL | PPL vs {ref_label} | mean KL vs {ref_label} (nats/token) | top-1 agreement | scored tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kl = "n/a" if r.kl is None else f"{r.kl:.5f}"
        top1 = "n/a" if r.top1 is None else f"{r.top1:.2%}"
        lines.append(f"| {r.label} | {r.ppl:.4f} | {r.ppl_vs_ref:+.2f}% | {kl} | {top1} | {r.tokens} |")
    return "\n".join(lines)
