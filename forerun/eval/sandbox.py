"""Run a model's Python (a completion and its tests) in a child process, and say how it ended.

What each run gets:
- a fresh interpreter, `sys.executable -I` (no PYTHON* variables, no user site-packages, no
  script folder on sys.path), reading the program from stdin, in its own session;
- a fresh empty scratch folder as its working directory, HOME and TMPDIR, deleted afterwards
  with whatever the program wrote there;
- an environment built from nothing (PATH, HOME, TMPDIR, LANG): none of the parent's variables,
  so no proxy settings and no tokens or credentials reach it;
- resource limits set in the child before it starts (resource.setrlimit): address space
  (`memory_bytes`: an allocation past it raises MemoryError), CPU seconds (the timeout + 1,
  a backstop: SIGXCPU, then SIGKILL a second later), file size (`file_bytes`: a longer write
  fails), no core files;
- a wall-clock timeout, after which its whole process group is killed (SIGKILL); the group is
  killed after a normal exit too, so nothing it started outlives it;
- stdout discarded, stderr kept (its last `stderr_bytes`): its last line is the error.

What it does not get: no network namespace and no file-system jail. The program runs as this
user and could read or write through absolute paths what this user can. That suits HumanEval's
completions (small pure functions) on a machine without network, as forerun's is; it is not a
boundary against code written to escape.
"""
from __future__ import annotations

import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock; the process group is killed past it
    memory_bytes: int = 2 << 30  # RLIMIT_AS
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    stderr_bytes: int = 64 << 10  # the tail of stderr kept


@dataclass(frozen=True)
class Outcome:
    passed: bool  # exited with status 0 within the timeout
    error: str | None  # None if passed; "timeout", the exception's name ("AssertionError", "MemoryError"),
    #                    "signal SIGXCPU", or "exit 3"
    detail: str  # the last non-empty line of stderr ("" if none)
    seconds: float  # wall clock, start to exit (or kill)


def run_python(code: str, limits: Limits = Limits(), root: str | None = None) -> Outcome:
    """Run `code` as described in the module docstring; `root`: where the scratch folder is made
    (default: the system's temp folder)."""
    with tempfile.TemporaryDirectory(prefix="forerun-eval-", dir=root, ignore_cleanup_errors=True) as scratch, \
            tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
            cwd=scratch, env=_environment(scratch), start_new_session=True, preexec_fn=partial(_set_limits, limits),
        )
        timed_out = False
        try:
            proc.communicate(code.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
        seconds = time.perf_counter() - start
        detail = _last_line(_tail(err, limits.stderr_bytes))
    if timed_out:
        return Outcome(False, "timeout", detail, seconds)
    if proc.returncode == 0:
        return Outcome(True, None, detail, seconds)
    return Outcome(False, _error_kind(proc.returncode, detail), detail, seconds)


def _environment(scratch: str) -> dict[str, str]:
    return {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}


def _set_limits(limits: Limits):
    """In the child, between fork and exec: the limits, never above the hard limits it inherits."""
    cpu = math.ceil(limits.timeout_s) + 1
    for res, soft, hard in [(resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
                            (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
                            (resource.RLIMIT_CORE, 0, 0)]:
        _, inherited = resource.getrlimit(res)
        if inherited != resource.RLIM_INFINITY:
            soft, hard = min(soft, inherited), min(hard, inherited)
        resource.setrlimit(res, (soft, hard))


def _kill_group(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


def _tail(f, n: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - n))
    return f.read().decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _error_kind(returncode: int, detail: str) -> str:
    """How a failed run ended, from its exit status and stderr's last line.
    >>> _error_kind(1, "AssertionError"), _error_kind(1, "NameError: name 'x' is not defined")
    ('AssertionError', 'NameError')
    >>> _error_kind(-24, ""), _error_kind(3, "bye")
    ('signal SIGXCPU', 'exit 3')
    """
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    m = re.match(r"([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Iteration|Warning))(:|$)", detail)
    return m.group(1) if m else f"exit {returncode}"
