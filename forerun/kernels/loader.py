"""forerun's compiled kernels (kernels/*.cpp, one extension module), built at install.

Decoding at int8 spends most of a layer's time in small ops around the GEMM, not in it;
int8_rows.cpp does the activation scaling, quantisation, int8 dot products and epilogue in
one call, for any number of tokens; its siblings do the same for float32, int4,
GGUF blocks, chain attention and whole layers. They are compiled together, with torch's C++
extension builder (g++ and ninja), for the CPU they run on (`-march=native` picks
AVX512-VNNI where the CPU has it). `load()` returns the module, or None; where it came
from is `origin()` (`forerun --version` prints it):

- installed: `pip install --no-build-isolation -e .` (the Makefile's setup step) compiled
  it into forerun/kernels/_kernels*.so (setup.py). It is used while the key it carries
  matches the sources beside this file, torch's version and -march=native, and its CPU this
  one (kernels/build_key.py).
- runtime-built: otherwise one line on stderr says why (the sources changed since the
  install, torch was absent when it ran, another CPU), and the module is built for this run
  under forerun's cache dir (FORERUN_CACHE_DIR), in a folder named by its key: compiled in
  a fresh temporary folder beside it, then moved into place with os.replace. No build
  waits on another's lock, a killed build blocks nobody, and two builds of one key both
  succeed (the last move wins; both files are the same build).
- none: FORERUN_NO_KERNELS=1, or no compiler; callers keep their PyTorch paths.

FORERUN_KERNEL_MARCH (default `native`) builds for less than this CPU at run time, e.g.
`x86-64-v4` (AVX512 without VNNI: the plain C++ dot products) or `x86-64-v3` (AVX2), so the
bit-level tests can run each code path on one machine (tests/test_isa_levels.py).

A new `.cpp` beside the others is compiled into the module by its name alone; what it shares
with the others is declared in kernels.h, and it binds its functions in a
`bind_<file>(pybind11::module&)` that kernels.h declares and module.cpp's PYBIND11_MODULE calls.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from forerun.kernels import build_key
from forerun.kernels.build_key import cpu_flags_line

log = logging.getLogger(__name__)
SOURCES = build_key.sources()
MARCH = os.environ.get("FORERUN_KERNEL_MARCH", "native").strip() or "native"
NAME = "forerun_kernels"  # a runtime build's module is NAME_<march>_<key>
INSTALLED = "forerun.kernels._kernels"  # setup.py's build
ABANDONED_S = 24 * 3600  # a temporary build folder this old was a killed build's: removed


def cpu_flags() -> set[str]:
    """This CPU's feature flags ("avx512_vnni", "amx_int8", ...); empty where unreadable."""
    line = cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if line else set()


@dataclass(frozen=True)
class Build:
    """One build of the kernels: what it compiles and the hex keys it carries (kernels/build_key.py)."""

    sources: tuple[Path, ...]
    march: str
    digest: str  # the sources' and headers' names and bytes
    key: str  # + torch's version and march
    cpu: str  # this CPU's flags

    @classmethod
    def of(cls, sources: list[Path], torch_version: str, march: str) -> Build:
        digest = build_key.sources_digest(build_key.read_sources(build_key.key_files(sources)))
        key = build_key.build_key(digest, torch_version, march)
        return cls(tuple(sources), march, digest, key, build_key.cpu_tag())

    @property
    def name(self) -> str:
        """The runtime module's name (its PyInit_<name>), unique per key and CPU."""
        tag = hashlib.sha256((self.key + self.cpu).encode()).hexdigest()[:16]
        march = re.sub(r"\W", "_", self.march)
        return f"{NAME}_{march}_{tag}"


@dataclass(frozen=True)
class Kernels:
    module: object | None
    origin: str  # "installed", "runtime-built" or "none"
    where: str  # the module's file, or why there is none


def load():
    """The kernels' extension module, or None (with one log line saying why)."""
    return kernels().module


def origin() -> str:
    """Where `load()`'s module came from, e.g. "installed (.../forerun/kernels/_kernels...so)"."""
    k = kernels()
    return f"{k.origin} ({k.where})"


@functools.cache
def kernels() -> Kernels:
    if os.environ.get("FORERUN_NO_KERNELS"):
        return Kernels(None, "none", "FORERUN_NO_KERNELS=1")
    try:
        import torch

        from forerun.cache import cache_dir

        build = Build.of(SOURCES, str(torch.__version__), MARCH)
        stale = None
        if MARCH == "native":
            module, stale = installed(build, INSTALLED)
            if module is not None:
                return Kernels(module, "installed", module.__file__)
        module = runtime_build(build, cache_dir() / "kernels", stale)
        return Kernels(module, "runtime-built", module.__file__)
    except Exception as e:  # no compiler, no ninja, an exotic CPU: fall back, never fail
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
        log.warning("forerun: kernels not built (%s); using the slower PyTorch paths", why)
        return Kernels(None, "none", why)


def installed(build: Build, name: str) -> tuple[object | None, str | None]:
    """setup.py's module if it was built from `build`'s sources, torch and CPU, else (None, why)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        return None, "no kernels were built at install (torch was not importable when `pip install -e .` ran)"
    # Checked in the file's bytes (the build's strings), before any import: -march=native code
    # may use instructions another CPU lacks, and a stale module once imported would keep the
    # runtime build from loading in this process (pybind11 registers each class once).
    data = Path(spec.origin).read_bytes()
    if build.cpu.encode() not in data:
        return None, "the installed kernels were built for another CPU"
    if build.digest.encode() not in data:
        return None, "the installed kernels are stale (sources changed since `pip install -e .`)"
    if build.key.encode() not in data:
        return None, "the installed kernels were built for another torch"
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        return None, f"the installed kernels do not load ({str(e).splitlines()[0][:160]})"
    if getattr(module, "BUILD_KEY", None) != build.key:  # (the bytes above held it elsewhere: never seen)
        return None, "the installed kernels do not carry their key"
    return module, None


def runtime_build(build: Build, folder: Path, why: str | None = None):
    """`build`'s module from `folder`/<name>/, compiled there first unless a build of its key is."""
    final = folder / build.name / f"{build.name}.so"
    remedy = " — run `make setup` to rebuild once" if why else ""
    if final.exists():
        if why:
            print(f"forerun: {why}; using the kernels built at run time in {final.parent}{remedy}", file=sys.stderr)
        return _import(build.name, final)
    if why:
        print(f"forerun: {why}; rebuilding for this run into {final.parent}{remedy}", file=sys.stderr)
    print(f"forerun: compiling the kernels ({len(build.sources)} files, -march={build.march}; 1-3 min on 2 cores)...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    _compile(build, final)
    print(f"forerun: kernels built in {time.monotonic() - start:.0f} s: {final}", file=sys.stderr, flush=True)
    return _import(build.name, final)


def _compile(build: Build, final: Path) -> None:
    """Compiles `build` in a fresh folder beside `final`'s and moves the library to `final`.
    Torch's lock file lives in that folder only, so no other process ever waits on it."""
    from torch.utils import cpp_extension

    build_key.put_ninja_on_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final.parent.parent)
    tmp = tempfile.mkdtemp(prefix=f"{build.name}.build-", dir=final.parent.parent)
    try:
        # torch skips a second build of one name in a process as up to date (wrong in a fresh folder)
        getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(build.name, None)
        built = cpp_extension.load(
            name=build.name,
            sources=[str(s) for s in build.sources],
            extra_cflags=build_key.compile_args(build.march, build.key, build.digest, build.cpu),
            extra_ldflags=build_key.LDFLAGS,
            build_directory=tmp,
            is_python_module=False,  # the library, imported below from where it ends up
            verbose=False,
        )
        os.replace(built, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_abandoned(folder: Path) -> None:
    for tmp in folder.glob(f"{NAME}_*.build-*"):
        try:
            if time.time() - tmp.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _import(name: str, path: Path):
    """The extension module `name` (its PyInit_<name>) from the library at `path`."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module
