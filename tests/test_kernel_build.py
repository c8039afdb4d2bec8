"""How forerun's kernels are built and found (kernels/build_key.py, kernels/loader.py): the
key follows the sources' and headers' bytes, a stale installed module is refused with its reason and a
runtime build serves instead, and a runtime build never waits on a dead build's lock. A tiny
one-function module stands in for the real kernels (seconds to compile, not minutes)."""
import dataclasses
import doctest
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from forerun.kernels import loader as kernel_loader
from forerun.kernels import build_key
from forerun.kernels.loader import Build

ROOT = Path(__file__).resolve().parents[1]
TORCH = str(torch.__version__)
TINY = """#include <pybind11/pybind11.h>
#define FORERUN_STR_(x) #x
#define FORERUN_STR(x) FORERUN_STR_(x)
// %s
static long twice(long x) { return 2 * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("twice", &twice);
  m.attr("BUILD_KEY") = FORERUN_STR(FORERUN_BUILD_KEY);
  m.attr("BUILD_SOURCES") = FORERUN_STR(FORERUN_BUILD_SOURCES);
  m.attr("BUILD_CPU") = FORERUN_STR(FORERUN_BUILD_CPU);
}
"""
BUILD_IN_A_PROCESS = """import sys, torch
from pathlib import Path
from forerun.kernels import loader as k
build = k.Build.of(sorted(Path(sys.argv[1]).glob("*.cpp")), str(torch.__version__), "native")
m = k.runtime_build(build, Path(sys.argv[2]))
print(m.twice(21), m.BUILD_KEY == build.key)
"""


def tiny_sources(folder: Path, note: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_rows.cpp").write_text(TINY % note)
    return build_key.sources(folder)


@pytest.fixture(autouse=True)
def fresh_kernels():
    """Tests that swap the sources or the installed module's name must not leave their module cached."""
    kernel_loader.kernels.cache_clear()
    yield
    kernel_loader.kernels.cache_clear()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny module built by a separate process (as a user's would be), with a killed build's
    folder and its torch `lock` left beside it, and an abandoned one a day old."""
    root = tmp_path_factory.mktemp("kernels")
    sources = tiny_sources(root / "src", "version a")
    build = Build.of(sources, TORCH, "native")
    cache = root / "cache"
    dead = cache / f"{build.name}.build-killed"
    old = cache / f"{build.name}.build-abandoned"
    for leftover in (dead, old):
        leftover.mkdir(parents=True)
        (leftover / "lock").write_text("")  # torch's FileBaton: its holder is gone
    os.utime(old, (time.time() - 2 * kernel_loader.ABANDONED_S,) * 2)
    run = subprocess.run([sys.executable, "-c", BUILD_IN_A_PROCESS, str(root / "src"), str(cache)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    return build, cache, run


def test_the_key_follows_the_sources_bytes_only(tmp_path):
    a = tiny_sources(tmp_path / "a", "same")
    b = tiny_sources(tmp_path / "b", "same")
    (tmp_path / "b" / "notes.txt").write_text("not a .cpp, .cu or header: no part of a build")
    first, elsewhere = Build.of(a, TORCH, "native"), Build.of(b, TORCH, "native")
    assert (first.key, first.digest, first.name) == (elsewhere.key, elsewhere.digest, elsewhere.name)
    os.utime(a[0], (0, 0))  # a touched file with the same bytes
    assert Build.of(a, TORCH, "native") == first
    a[0].write_text(TINY % "same " + "\n")  # one byte more
    changed = Build.of(a, TORCH, "native")
    assert changed.digest != first.digest and changed.key != first.key and changed.name != first.name
    (tmp_path / "a" / "new.cpp").write_text("// a new kernel file: picked up by its name")
    assert len(build_key.sources(tmp_path / "a")) == 2
    other_torch, other_march = Build.of(b, "2.99.0", "native"), Build.of(b, TORCH, "x86-64-v3")
    assert other_torch.digest == first.digest and len({first.key, other_torch.key, other_march.key}) == 3


def test_doctests():
    assert doctest.testmod(build_key).failed == 0


def test_the_real_sources_are_every_cpp_file_of_the_kernels_room():
    assert kernel_loader.SOURCES == sorted((ROOT / "forerun" / "kernels").glob("*.cpp"))
    assert {"module.cpp", "int8_rows.cpp", "gguf_rows.cpp"} <= {s.name for s in kernel_loader.SOURCES}
    assert (ROOT / "forerun" / "kernels" / "kernels.h") in build_key.key_files(kernel_loader.SOURCES)


def test_an_edited_header_changes_the_key(tmp_path):
    sources = tiny_sources(tmp_path, "same")
    (tmp_path / "shared.h").write_text("#pragma once\n")
    first = Build.of(sources, TORCH, "native")
    (tmp_path / "shared.h").write_text("#pragma once\nint edited();\n")
    edited = Build.of(sources, TORCH, "native")
    assert edited.sources == first.sources  # a header is not compiled on its own...
    assert edited.digest != first.digest and edited.key != first.key  # ...but a build is made from it


def test_a_runtime_build_announces_itself_and_ignores_a_dead_builds_lock(built):
    build, cache, run = built
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["42", "True"]
    assert "forerun: compiling the kernels (1 files, -march=native" in run.stderr
    assert "forerun: kernels built in " in run.stderr and " s: " in run.stderr
    assert (cache / build.name / f"{build.name}.so").exists()
    assert (cache / f"{build.name}.build-killed" / "lock").exists()  # not waited on, not removed
    assert not (cache / f"{build.name}.build-abandoned").exists()  # a day old: removed
    assert not [p for p in cache.iterdir() if ".build-" in p.name and not p.name.endswith("killed")]


def test_a_runtime_build_of_the_same_key_is_reused(built, capsys):
    build, cache, _ = built
    module = kernel_loader.runtime_build(build, cache)
    assert module.twice(4) == 8 and capsys.readouterr().err == ""


def test_an_installed_module_is_checked_against_sources_torch_and_cpu(built, tmp_path, monkeypatch):
    build, cache, _ = built
    monkeypatch.syspath_prepend(str(cache / build.name))  # the tiny module stands in for the installed one
    assert kernel_loader.installed(build, build.name)[1] is None
    edited = Build.of(tiny_sources(tmp_path / "src", "version b"), TORCH, "native")
    assert "are stale (sources changed" in kernel_loader.installed(edited, build.name)[1]
    assert "another torch" in kernel_loader.installed(dataclasses.replace(build, key="0" * 64), build.name)[1]
    assert "another CPU" in kernel_loader.installed(dataclasses.replace(build, cpu="0" * 16), build.name)[1]
    assert "no kernels were built at install" in kernel_loader.installed(build, "forerun_no_such_module")[1]


def test_a_stale_installed_module_is_refused_and_built_at_run_time(built, tmp_path, monkeypatch, capsys):
    build, cache, _ = built
    monkeypatch.syspath_prepend(str(cache / build.name))
    monkeypatch.setattr(kernel_loader, "INSTALLED", build.name)
    monkeypatch.setattr(kernel_loader, "SOURCES", tiny_sources(tmp_path / "src", "version b"))  # edited since
    monkeypatch.setattr(kernel_loader, "MARCH", "native")
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FORERUN_NO_KERNELS", raising=False)
    monkeypatch.delitem(sys.modules, build.name, raising=False)
    got = kernel_loader.kernels()
    err = capsys.readouterr().err.splitlines()
    assert got.origin == "runtime-built" and got.module.twice(5) == 10, err
    # refused from its bytes, never imported: an imported stale module's pybind11 classes would
    # keep the fresh build from loading in this process
    assert build.name not in sys.modules
    assert got.module.BUILD_SOURCES != build.digest and got.where.startswith(str(tmp_path / "cache" / "kernels"))
    assert [line for line in err if "kernels are stale" in line] == [
        f"forerun: the installed kernels are stale (sources changed since `pip install -e .`); rebuilding for this "
        f"run into {Path(got.where).parent} — run `make setup` to rebuild once"]
    assert any(line.startswith("forerun: compiling") for line in err)
    assert any(line.startswith("forerun: kernels built in ") for line in err)


def test_no_kernels_when_asked(monkeypatch):
    monkeypatch.setenv("FORERUN_NO_KERNELS", "1")
    assert kernel_loader.load() is None and kernel_loader.origin() == "none (FORERUN_NO_KERNELS=1)"
