"""The int8 bit-level tests under lower CPU levels than this machine's, in subprocesses:
oneDNN capped by ONEDNN_MAX_CPU_ISA (read once, at its first use: hence a new process),
torch's own vectorised ops (SDPA, norms, softmax) by ATEN_CPU_CAPABILITY, and forerun's
kernel compiled for less than the host (FORERUN_KERNEL_MARCH). A CPU with AMX
then also checks the AVX512-VNNI-only path, and every CPU checks AVX512 without VNNI and
AVX2, so a change that breaks one of them fails here, not on a user's machine. int4's fitted
weight grid must also come out byte for byte as on the host at each level.

A level whose kernel did not build fails (with a C++ compiler on the machine): its sub-suite
would otherwise skip every bit-level test and pass."""
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forerun.kernels.loader import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
BIT_LEVEL_TESTS = ["tests/test_quant.py", "tests/test_int8_identity.py", "tests/test_int4.py",
                   "tests/test_gguf_native.py", "tests/test_gguf_packed.py", "tests/test_gemma3_invariance.py",
                   "tests/test_kv_float16.py"]
LEVELS = [  # (ONEDNN_MAX_CPU_ISA, FORERUN_KERNEL_MARCH, ATEN_CPU_CAPABILITY, CPU flags the level needs)
    ("AVX512_CORE_VNNI", "native", "", {"avx512_vnni"}),
    ("AVX512_CORE", "x86-64-v4", "avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ("AVX2", "x86-64-v3", "avx2", {"avx2", "fma", "bmi2"}),
]


# A digest of int4's fitted grids for a fixed matrix with outliers: groups of 64 (u, d, m; a
# part-padding last group) and Q4_K blocks (of its first 768 inputs).
FIT_DIGEST = """
import hashlib, torch
from forerun.kernels import loader as kernel_loader
from forerun.linears.int4 import quantize_groups
g = torch.Generator().manual_seed(3)
w = torch.randn(300, 1000, generator=g)
w[::5, ::11] *= 8
fits = [*quantize_groups(w), kernel_loader.load().int4_fit_q4k(w[:, :768].contiguous())]
print(hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in fits)).hexdigest())
"""


def fit_digest() -> str:
    return subprocess.run([sys.executable, "-c", FIT_DIGEST], cwd=ROOT, capture_output=True, text=True,
                          timeout=900).stdout.strip().splitlines()[-1]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 ISA levels")
@pytest.mark.parametrize("isa,march,aten,needs", LEVELS, ids=[level[0] for level in LEVELS])
def test_int8_bits_hold_at_this_isa_level(isa, march, aten, needs):
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa, FORERUN_KERNEL_MARCH=march)
    if aten:
        env["ATEN_CPU_CAPABILITY"] = aten
    probe = "from forerun.kernels import loader as k; m = k.load(); print(None if m is None else m.has_vnni())"
    built = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    vnni = built.stdout.strip().splitlines()[-1] if built.stdout.strip() else "None"
    if shutil.which("c++") or shutil.which("g++"):
        assert vnni != "None", f"no kernel built at -march={march}:\n{built.stdout[-2000:]}\n{built.stderr[-3000:]}"
    if march != "native":  # the level's kernel really is the lower one (or none where g++ is missing)
        assert vnni in ("False", "None"), built.stdout + built.stderr
    if vnni != "None":  # int4's weight grid: the same bytes from this level's kernel as from the host's
        fitted = subprocess.run([sys.executable, "-c", FIT_DIGEST], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=900)
        assert fitted.stdout.strip().splitlines()[-1:] == [fit_digest()], fitted.stdout + fitted.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BIT_LEVEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, f"ONEDNN_MAX_CPU_ISA={isa} FORERUN_KERNEL_MARCH={march}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    summary = run.stdout.strip().splitlines()[-1]
    assert "passed" in summary and (vnni == "None" or "skipped" not in summary), run.stdout[-2000:]
