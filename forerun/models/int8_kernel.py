"""The compiled int8 kernel for a few tokens per forward (int8_rows.cpp), built on first use.

Decoding at int8 spends most of a layer's time in small ops around the GEMM, not in it;
this kernel does the per-token scaling, quantisation, int8 dot products and epilogue in
one call, with the same bits as the fbgemm path. It is compiled once per machine with
torch's C++ extension builder (g++ and ninja; `-march=native` picks AVX512-VNNI where the
CPU has it) and cached by torch (TORCH_EXTENSIONS_DIR). Without a compiler, or with
FORERUN_NO_KERNELS=1, `load()` returns None and Int8Linear keeps its pure-PyTorch path.

FORERUN_KERNEL_MARCH (default `native`) builds for less than this CPU, e.g. `x86-64-v4`
(AVX512 without VNNI: the plain C++ dot products) or `x86-64-v3` (AVX2), so the bit-level
tests can run each code path on one machine (tests/test_isa_levels.py).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("int8_rows.cpp")
SOURCES = [SOURCE] + [Path(__file__).with_name(f) for f in ("f32_rows.cpp", "int4_rows.cpp", "attention_rows.cpp", "layer_rows.cpp", "gguf_rows.cpp")]


def cpu_flags_line() -> str | None:
    """The `flags` line of /proc/cpuinfo (every feature this CPU reports), or None."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags ("avx512_vnni", "amx_int8", ...); empty where unreadable."""
    line = cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if line else set()


def _cpu_tag() -> str:
    """`-march=native` code must not be reused on another CPU (a home directory shared
    between machines): the build's name carries a hash of this CPU's feature flags."""
    flags = cpu_flags_line() or platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


MARCH = os.environ.get("FORERUN_KERNEL_MARCH", "native").strip() or "native"
NAME = f"forerun_int8_rows_{_cpu_tag()}" + ("" if MARCH == "native" else "_" + hashlib.sha1(MARCH.encode()).hexdigest()[:6])


@functools.cache
def load():
    """The built extension module, or None (with one log line saying why)."""
    if os.environ.get("FORERUN_NO_KERNELS"):
        return None
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        if not _already_built(cpp_extension):
            print("forerun: compiling the int8 kernel once for this machine (about 40 s)...", file=sys.stderr, flush=True)
        return cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", f"-march={MARCH}", "-ffp-contract=off", "-fopenmp"],  # no silent FMA: same bits every path
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, an exotic CPU: fall back, never fail
        log.warning("forerun: int8 kernel not built (%s); using the slower PyTorch path", str(e).splitlines()[0][:200])
        return None


def _already_built(cpp_extension) -> bool:
    """Best effort (a private torch helper): is a built module in torch's cache already?
    torch itself still decides whether to rebuild (it hashes the source and flags)."""
    try:
        return (Path(cpp_extension._get_build_directory(NAME, False)) / f"{NAME}.so").exists()
    except Exception:
        return True  # no message rather than a wrong one


def _put_ninja_on_path():
    """torch's builder runs `ninja` from PATH; the pip `ninja` package may live only in the venv."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
