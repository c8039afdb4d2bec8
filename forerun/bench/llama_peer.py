"""llama.cpp's `llama-server` as the peer in the serve matrix: where its binary is, and its
command line for one configuration at N parallel slots (one per client), on the GGUF that
forerun's own model was converted from.

Speculation maps onto its flags like this (checked against `llama-server --help` of the
llama.cpp inside llama-cpp-python 0.3.36): a draft model is `--spec-type draft-simple -md
DRAFT.gguf --spec-draft-n-max k`; forerun's prompt lookup is `--spec-type ngram-simple`, which
looks up one fixed n-gram (`--spec-ngram-simple-size-n`, 3 here: forerun tries 4 down to 2) and
drafts the `--spec-ngram-simple-size-m` = k tokens after its last match.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LLAMA_ENV = "FORERUN_LLAMA_CPP_BIN"  # the llama.cpp bin folder, as for bench's llama.cpp peers
NGRAM_N = 3


def find_llama_server(given: str | None) -> Path | None:
    """`given` (the binary, or the folder holding it), else $FORERUN_LLAMA_CPP_BIN/llama-server;
    None when neither names an existing file."""
    where = given or os.environ.get(LLAMA_ENV)
    if not where:
        return None
    path = Path(where).expanduser()
    path = path / "llama-server" if path.is_dir() else path
    return path if path.is_file() else None


@dataclass(frozen=True)
class LlamaSetup:
    binary: Path
    gguf: Path  # the verifier's GGUF
    threads: int
    ctx_per_slot: int  # prompt + generated tokens a slot holds (forerun's --max-len)
    k: int  # draft length, as forerun's --k
    draft_gguf: Path | None = None
    extra: tuple[str, ...] = ()  # more flags, as given (--llama-args)


def llama_configs(method: str | None, has_draft: bool) -> list[str]:
    """Which llama-server configurations match a forerun run: always plain, and the
    speculation that corresponds to forerun's method when llama.cpp has one."""
    if method == "draft_model" and has_draft:
        return ["plain", "draft"]
    if method == "ngram":
        return ["plain", "ngram"]
    return ["plain"]


def llama_argv(setup: LlamaSetup, config: str, slots: int, port: int) -> list[str]:
    """llama-server's command line for `config` ("plain", "ngram" or "draft") with `slots`
    parallel sequences, each of setup.ctx_per_slot tokens, listening on 127.0.0.1:port."""
    t = str(setup.threads)
    argv = [str(setup.binary), "-m", str(setup.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
            "--parallel", str(slots), "-c", str(slots * setup.ctx_per_slot), "--no-webui"]
    if config == "draft":
        if setup.draft_gguf is None:
            raise ValueError("llama-server draft configuration without a draft GGUF")
        argv += ["--spec-type", "draft-simple", "-md", str(setup.draft_gguf), "--spec-draft-n-max", str(setup.k),
                 "-td", t, "-tbd", t]
    elif config == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_N),
                 "--spec-ngram-simple-size-m", str(setup.k)]
    elif config != "plain":
        raise ValueError(f"unknown llama-server configuration {config!r}")
    return argv + list(setup.extra)
