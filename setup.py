"""Compiles forerun's C++ kernels (forerun/kernels/*.cpp) into forerun.kernels._kernels at
install, for this CPU (-march=native). pyproject.toml holds the metadata; this adds the extension.

torch must be installed first and visible to the build, which an isolated build env would
not be (and must not be: a bare torch from PyPI is a multi-GB CUDA build), hence
`pip install --no-build-isolation -e .` (the Makefile's setup step). Without torch no
extension is built: forerun then compiles its kernels at first use (kernels/loader.py).
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _kernel_key():
    """forerun/kernels/build_key.py by path (the standard library only): forerun is not installed yet."""
    spec = importlib.util.spec_from_file_location("forerun_kernel_key", ROOT / "forerun" / "kernels" / "build_key.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_extension():
    """([the extension], {"build_ext": torch's builder}), or ([], {}) where none can be built."""
    if os.environ.get("FORERUN_NO_KERNELS"):
        print("forerun: FORERUN_NO_KERNELS is set: building no kernels", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        print(f"forerun: torch is not importable here ({e}): building no kernels; forerun will compile them at "
              "first use. Install torch first, then `pip install --no-build-isolation -e .`", file=sys.stderr)
        return [], {}
    key = _kernel_key()
    key.put_ninja_on_path()
    sources = key.sources(ROOT / "forerun" / "kernels")
    digest = key.sources_digest(key.read_sources(key.key_files(sources)))
    build = key.build_key(digest, str(torch.__version__), "native")
    # A .cu source (a CUDA path) would need CUDAExtension and nvcc; today every source is C++.
    ext = CppExtension(
        "forerun.kernels._kernels",
        [str(s.relative_to(ROOT)) for s in sources],
        extra_compile_args=key.compile_args("native", build, digest, key.cpu_tag()),
        extra_link_args=key.LDFLAGS,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = kernel_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
