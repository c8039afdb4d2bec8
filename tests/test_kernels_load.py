"""The compiled kernels load wherever they can be built, so the bit-level tests cannot skip unseen.

Every int8 / int4 / gguf / float32-kernel bit test skips where the kernels are missing (a
machine without a compiler has no other path). On x86-64 with a C++ compiler they must load:
a moved source the build's glob no longer finds, package data that drops a file, or a compile
error would otherwise skip every bit-level test and leave the suite green. This test fails
instead. It also checks that the module holds every function each source binds (a source left
out of the build would lose its functions) and that it was built from the sources shipped
beside the loader, not a stale copy.
"""
import os
import platform
import re
import shutil

import pytest

from forerun.kernels import loader as kernel_loader
from forerun.kernels import build_key

CAN_BUILD = platform.machine() in ("x86_64", "AMD64") and bool(shutil.which("c++") or shutil.which("g++"))
ASKED_FOR_NONE = bool(os.environ.get("FORERUN_NO_KERNELS"))


def bound_names(source: str) -> set[str]:
    """The Python names a kernel source binds: each `m.def("name", ...)`.

    >>> sorted(bound_names('m.def("a_rows", &a); m.def( "b" , &b);'))
    ['a_rows', 'b']
    """
    return set(re.findall(r'm\.def\(\s*"(\w+)"', source))


def test_doctest():
    import doctest
    import sys

    assert doctest.testmod(sys.modules[__name__]).failed == 0


@pytest.mark.skipif(ASKED_FOR_NONE, reason="FORERUN_NO_KERNELS is set: the run asked for the PyTorch paths")
def test_the_kernels_load_on_a_machine_that_can_build_them():
    k = kernel_loader.kernels()
    if not CAN_BUILD:
        assert k.module is None or k.origin != "none"
        pytest.skip(f"not x86-64 with a C++ compiler ({platform.machine()}): the kernels may be absent here")
    assert k.module is not None, f"the kernels did not load: {k.origin} ({k.where})"
    assert k.origin in ("installed", "runtime-built")


@pytest.mark.skipif(ASKED_FOR_NONE or not CAN_BUILD, reason="needs the kernels built (x86-64, a C++ compiler)")
def test_the_loaded_module_is_built_from_every_shipped_source():
    module = kernel_loader.load()
    sources = build_key.sources()
    assert len(sources) >= 6, [s.name for s in sources]  # the build's glob still finds the files
    assert module.BUILD_SOURCES == build_key.sources_digest(build_key.read_sources(build_key.key_files(sources)))
    for source in sources:
        names = bound_names(source.read_text())
        missing = sorted(n for n in names if not hasattr(module, n))
        assert not missing, f"{source.name} binds {missing}, absent from the loaded module"
    assert callable(module.has_vnni) and callable(module.decoder_layer_rows)


@pytest.mark.skipif(ASKED_FOR_NONE or not CAN_BUILD, reason="needs the kernels built (x86-64, a C++ compiler)")
def test_each_precision_is_finished_on_its_backend():
    """The seam (kernels/backend.py) is chosen once when the model is finished: the quantized
    precisions on the kernels with their fused ops, float32 on the kernels' attention only,
    float64 (and every model without the kernels) on plain torch."""
    from forerun.kernels.backend import CpuKernels, TorchBackend
    from forerun.llm import LLM
    from tests.tiny import tiny_model

    for dtype, fused in (("int8", True), ("int4", True), ("float32", False)):
        backend = LLM(tiny_model(dtype=dtype, hidden_size=64, intermediate_size=128), dtype=dtype).model.backend
        assert isinstance(backend, CpuKernels) and backend.fused == fused, dtype
    assert type(tiny_model(dtype="float64").backend) is TorchBackend
