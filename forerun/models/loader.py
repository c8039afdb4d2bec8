"""Build a decoder from a HF model folder, a GGUF file or a hub id, at a chosen precision."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from forerun.config import check_dtype
from forerun.errors import ModelLoadError, did_you_mean
from forerun.models.config import GEMMA3, LLAMA_FAMILY, ModelConfig
from forerun.models.gemma3 import Gemma3ForCausalLM
from forerun.models.llama import LlamaForCausalLM, fuse_hf_state_dict
from forerun.models.rope import inv_frequencies
from forerun.precision import Precision

# ModelConfig.model_type -> the decoder class that runs it.
MODEL_CLASSES = {**dict.fromkeys(LLAMA_FAMILY, LlamaForCausalLM), GEMMA3: Gemma3ForCausalLM}


def resolve_model_dir(model: str | Path | None, progress: bool = True) -> Path:
    """None -> embedded default; an embedded model's name ("smollm2-135m", "gemma3-270m"); a folder;
    a .gguf (converted once, cached); else a hub id. (A folder named like an embedded model: ./name.)"""
    from forerun.embedded import EMBEDDED_MODELS, default_model_dir

    if model is None or str(model) == "default":
        return default_model_dir(progress=progress)
    if str(model) in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[str(model)](progress=progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _converted_gguf(path, progress)
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise ModelLoadError(f"model not found: {model!r}{did_you_mean(model, EMBEDDED_MODELS)}; expected a model "
                             f"folder, a .gguf file, a hub id (owner/name) or an embedded model: {', '.join(EMBEDDED_MODELS)}")
    return _hub_snapshot(str(model))


def _converted_gguf(path: Path, progress: bool) -> Path:
    from forerun.cache import cache_dir
    from forerun.gguf.convert import convert_gguf_to_hf

    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "converted" / f"{path.stem}-{key}"
    if not (out / "config.json").exists():
        convert_gguf_to_hf(path, out, progress=progress, weights=False)  # float32 weights: on first use
    return out


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # network, auth, missing repo: all the user's to fix
        raise ModelLoadError(f"could not fetch {repo_id!r} from the hub: {e}") from None


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors file(s), sharded or not."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    except (json.JSONDecodeError, KeyError, AttributeError):
        raise ModelLoadError(f"{index} is not a valid safetensors index") from None
    files = files or sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder}")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(folder / name)))  # views of the mapped file (see load_model)
        except Exception as e:
            raise ModelLoadError(f"corrupt or unreadable weights file {folder / name}: {e}") from None
    return state


def resolve_precision(dtype: str | Precision, folder: Path | None, device="cpu", kv_cache: str = "auto") -> Precision:
    """The precision `dtype` names for `folder` on `device`, resolved once: "auto" -> "gguf" for a
    folder converted from a GGUF file whose linears are quantized in a type the native kernels
    read, on the CPU with the kernels built; else "float32". Other dtypes are kept as they are.
    kv_cache: the KV cache's dtype (Precision.kv_cache; a Precision given keeps its own)."""
    if isinstance(dtype, Precision):
        return dtype
    check_dtype(dtype)
    cpu = torch.device(device).type == "cpu"
    kernel = None
    if cpu:
        from forerun.kernels import loader as kernel_loader

        kernel = kernel_loader.load()
    blocks = False
    if folder is not None and cpu and kernel is not None and hasattr(kernel, "gguf_rows"):
        from forerun.gguf.place import quantized_source

        blocks = quantized_source(folder)
    name = dtype if dtype != "auto" else ("gguf" if blocks else "float32")
    return Precision(name, str(device), kernels=kernel is not None, gguf_blocks=blocks, kv_cache=kv_cache)


def resolve_dtype(dtype: str, folder: Path | None, device="cpu") -> str:
    """resolve_precision's name: "auto" -> "gguf" or "float32"; others as they are."""
    return resolve_precision(dtype, folder, device).name


def ensure_float_weights(folder: Path) -> None:
    """A converted GGUF folder holds no float32 weights until a float precision first needs them."""
    from forerun.gguf.convert import source_of, write_weights

    source = source_of(folder)
    if source is not None and not any(folder.glob("*.safetensors")):
        import sys

        print(f"forerun: dequantizing {source.name} to float32 once (dtype gguf needs no copy)", file=sys.stderr, flush=True)
        write_weights(folder, source)


def load_model(folder: Path, dtype: str | Precision = "auto", device: str | torch.device = "cpu") -> torch.nn.Module:
    """The decoder class MODEL_CLASSES names for the folder's config.json, loaded and finished
    at `dtype` (a Precision, or a dtype string resolved here once)."""
    precision = resolve_precision(dtype, folder, device)
    dtype, device = precision.name, precision.device
    # gguf: every linear on the file's own blocks (linears/gguf.py, placed by gguf/place.py); int8 / int4 of such
    # a file: quantized from those blocks, one matrix at a time (no float32 copy, on disk or in memory)
    if dtype == "gguf" or precision.from_blocks:
        from forerun.gguf.place import native_source, place_native_

        source = native_source(folder, device)
        model = _on_meta(folder)
        place_native_(model, source)  # a tied head reads the embedding's blocks
        if dtype != "gguf":
            requantize_(model, dtype)
        return finish_model(model, precision, device)
    model = _on_meta(folder)
    cfg = model.config
    ensure_float_weights(folder)
    state = read_state_dict(folder)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    target = precision.float_dtype
    # Copies, not views of the file: safetensors maps the file, and tensors kept as they are
    # (the embedding table, norms, every float32 weight) would stay page cache, which the kernel
    # reclaims when they sit cold. Then a lookup of rarely used embedding rows reads the disk:
    # prompts here stalled 0.8-6.5 s on a 120-token lookup. The dtype conversion makes that copy
    # (one copy per tensor, where the dtype changes too).
    state = {k: v.to(target, copy=True) for k, v in state.items()}
    try:
        if isinstance(model, LlamaForCausalLM):
            state = fuse_hf_state_dict(state)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except (RuntimeError, KeyError) as e:  # shape mismatches, a missing q/k/v part
        raise ModelLoadError(f"weights in {folder} do not match its config.json: {str(e).splitlines()[0]}") from None
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"weights in {folder} do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return finish_model(model, precision, device)


def requantize_(model: torch.nn.Module, dtype: str) -> None:
    """Each GGUFLinear of `model` (linears/gguf.py) replaced by its int8 / int4 quantization, one at a
    time: only one matrix is ever dequantized to float32 (ggml's dequantization: the values the
    float32 model holds, so int8 equals quantizing that model). int4 keeps the file's Q4_K blocks
    as they are (quant4.int4_of_blocks). The embedding keeps its blocks."""
    from forerun.linears.gguf import GGUFLinear
    from forerun.linears.swap import swap_linears

    if dtype == "int8":
        from forerun.linears.int8 import Int8Linear as make
    else:
        from forerun.linears.int4 import int4_of_blocks as make
    swap_linears(model, lambda child: make(child) if isinstance(child, GGUFLinear) else None)


def _on_meta(folder: Path) -> torch.nn.Module:
    """The decoder class MODEL_CLASSES names for the folder's config.json, without weights yet."""
    cfg = ModelConfig.from_file(folder / "config.json")
    with torch.device("meta"):
        return MODEL_CLASSES[cfg.model_type](cfg)


def finish_model(model: torch.nn.Module, dtype: str | Precision, device) -> torch.nn.Module:
    """Place, quantise, choose the backend, set the KV cache's dtype (a Precision's; a dtype
    string: the model's own); the common tail of every way of building a model (each ties its
    own head)."""
    kv_cache = dtype.kv_cache if isinstance(dtype, Precision) else "auto"
    dtype = str(dtype)
    cfg = model.config
    # Built on the meta device, the RoPE buffers hold no data yet: compute them here.
    if isinstance(model, LlamaForCausalLM):
        model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    else:
        model.init_rope()
    model = model.to(device)
    if dtype in ("int8", "int4") and torch.device(device).type != "cpu":
        raise ModelLoadError(f"dtype {dtype} is a CPU path; use bfloat16 on an accelerator")
    if dtype in ("int8", "int4"):
        from forerun.linears.int4 import to_int4_
        from forerun.linears.int8 import to_int8_

        try:  # (no fallback without the kernels: refused with the reason)
            (to_int8_ if dtype == "int8" else to_int4_)(model)
        except RuntimeError as e:
            raise ModelLoadError(str(e)) from None
    elif dtype == "gguf":  # per-query chain attention: a row's bits never depend on its batch-mates
        from forerun.linears.int8 import finish_on_kernels_

        finish_on_kernels_(model)  # llama: RMSNorms folded into the linears, a layer in one call
    elif dtype == "float32" and torch.device(device).type == "cpu":
        from forerun.kernels import loader as kernel_loader
        from forerun.linears.f32 import use_f32_kernels_

        kernel = kernel_loader.load()
        if kernel is not None:  # else torch's sgemm: same function, not batch-invariant
            use_f32_kernels_(model, kernel)
    model.set_kv_cache(kv_cache)
    return model.eval().requires_grad_(False)
