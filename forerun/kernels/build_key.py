"""What a build of forerun's C++ kernels is made from, and the key that names it.

The standard library only: setup.py loads this file by path (forerun's own imports may not
be installed yet when it runs), and kernels/loader.py imports it to check a build.

The kernels are every `.cpp` beside this file (a `.cu` too, once a CUDA build takes one),
compiled into one extension module; the headers beside them (`kernels.h`) are part of what
a build is made from, so an edited header rebuilds as an edited source does. Its key is
SHA-256 over those files' names and bytes, torch's version and the `-march`; the build
carries it (and its CPU's flags) as preprocessor tokens, which module.cpp exposes as
BUILD_KEY, BUILD_SOURCES and BUILD_CPU. A build is reused only while all three still match
(kernels/loader.py).

    >>> a, b = Path("a_rows.cpp"), Path("b_rows.cpp")
    >>> key = build_key(sources_digest({a: b"x", b: b"y"}), "2.13.0+cpu", "native")
    >>> key == build_key(sources_digest({b: b"y", a: b"x"}), "2.13.0+cpu", "native")  # order-free
    True
    >>> key == build_key(sources_digest({a: b"x", b: b"y2"}), "2.13.0+cpu", "native")
    False
"""
from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
SOURCE_GLOBS = ("*.cpp", "*.cu")  # compiled, each into the one module
HEADER_GLOBS = ("*.h", "*.cuh")  # included by the sources: in the key, not compiled on their own
# -O3 and no silent FMA contraction (the same bits on every path); -g0 cancels the -g that
# setuptools takes from Python's own build flags (torch's runtime builder passes none).
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-g0"]
LDFLAGS = ["-fopenmp"]


def sources(folder: Path = KERNELS) -> list[Path]:
    """The kernel sources: every `.cpp` (and `.cu`) in `folder`, by name (a new file needs no edit here)."""
    return sorted(p for pattern in SOURCE_GLOBS for p in folder.glob(pattern))


def key_files(sources: list[Path]) -> list[Path]:
    """What a build of `sources` is made from: the sources and the headers beside them."""
    folders = sorted({p.parent for p in sources})
    return sorted(set(sources) | {h for f in folders for pattern in HEADER_GLOBS for h in f.glob(pattern)})


def read_sources(paths: list[Path]) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


def sources_digest(contents: dict[Path, bytes]) -> str:
    """SHA-256 over each source's file name and bytes, in name order (not over where they lie)."""
    h = hashlib.sha256()
    for path in sorted(contents, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0" + contents[path] + b"\0")
    return h.hexdigest()


def build_key(digest: str, torch_version: str, march: str) -> str:
    """What a build's code depends on besides the CPU: sources, torch (its headers and ABI), -march."""
    return hashlib.sha256(f"{digest}\0torch={torch_version}\0march={march}".encode()).hexdigest()


def cpu_flags_line() -> str | None:
    """The `flags` line of /proc/cpuinfo (every feature this CPU reports), or None."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None


def cpu_tag() -> str:
    """`-march=native` code must not run on another CPU (a home directory or a venv shared
    between machines): a hash of this CPU's feature flags names the CPU a build is for."""
    flags = cpu_flags_line() or platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def compile_args(march: str, key: str, digest: str, cpu: str) -> list[str]:
    """The compiler flags of a build. The three hex strings go in as bare tokens (int8_rows.cpp
    stringizes them): no quotes for a shell or a ninja file to mangle."""
    return CFLAGS + [f"-march={march}", f"-DFORERUN_BUILD_KEY={key}", f"-DFORERUN_BUILD_SOURCES={digest}",
                     f"-DFORERUN_BUILD_CPU={cpu}"]


def put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip `ninja` package may live only in the venv."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
