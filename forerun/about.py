"""What `forerun --version` prints: versions, and which CPU-dependent numeric paths this
machine runs (the compiled kernels decide whether int8 / int4 / gguf are available and
batch-invariant here; see docs/ARCHITECTURE.md, "Paths chosen by the CPU")."""
from __future__ import annotations

import os
import platform


def cpu_features() -> list[str]:
    """The CPU flags that change a numeric path (AMX, AVX512-VNNI/BF16, AVX-VNNI, AVX2)."""
    from forerun.kernels.loader import cpu_flags

    wanted = ("amx_tile", "amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx512f", "avx2")
    have = cpu_flags()
    return [f for f in wanted if f in have]


def int8_paths() -> dict[str, str]:
    """The int8 path's pieces on this machine (builds the kernel if it is not built yet)."""
    from forerun.kernels import loader as kernel_loader

    kernel = kernel_loader.load()
    if kernel is None:
        return {"int8 / int4": "refused (no compiled kernel)", "chain attention": "SDPA"}
    dots = "AVX512-VNNI" if kernel.has_vnni() else "plain C++ dot products"
    int4 = kernel.int4_isa() if hasattr(kernel, "int4_isa") else "scalar"
    isa = kernel.gguf_packed_isa() if hasattr(kernel, "gguf_packed_isa") else "scalar"
    gguf = f"packed tiles of 16 rows, {isa}" if isa != "scalar" else "the file's row-major blocks (row kernel)"
    return {"int8 / int4": f"forerun kernel, every size, -march={kernel_loader.MARCH}, int8 {dots}, int4 {int4}",
            "gguf": gguf, "chain attention": "per-query kernel"}


def kernels_origin() -> str:
    """Where the compiled kernels came from: installed (built by `pip install -e .`), runtime-built
    (stale or missing at install, or a forced -march), or none, with the file or the reason."""
    from forerun.kernels import loader as kernel_loader

    return kernel_loader.origin()


def describe() -> str:
    import torch

    import forerun

    lines = [
        f"forerun {forerun.__version__}",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, Python {platform.python_version()}",
        f"CPU: {platform.machine()}, {' '.join(cpu_features()) or 'no AVX2/AVX512 flags read'}"
        + (f" (ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']})" if os.environ.get("ONEDNN_MAX_CPU_ISA") else ""),
    ]
    lines += [f"{k}: {v}" for k, v in int8_paths().items()]
    lines.append(f"kernels: {kernels_origin()}")
    return "\n".join(lines)
