"""A GGUF file's tensors placed in a model: dtype "gguf" reads every matrix's blocks from the
file (linears/gguf.py computes with them), and everything else (norms, biases, a float or
unsupported-type matrix) is dequantized to float32 exactly as the float32 path does.
Weights are read once from the mapped file into memory (rows of a llama q/k projection put
back in Hugging Face's RoPE order: a reordering of whole rows, the bytes unchanged).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from forerun.errors import ModelLoadError
from forerun.gguf.convert import source_of
from forerun.linears.gguf import NATIVE_TYPES, Blocks, GGUFEmbedding, GGUFLinear, kernels
from forerun.linears.swap import set_module




def quantized_source(folder: Path) -> bool:
    """Whether `folder` came from a GGUF whose projection matrices are mostly of native types
    (a float16 / float32 GGUF is served best at float32)."""
    path = source_of(folder)
    if path is None:
        return False
    from forerun.gguf.index import gguf_index

    try:
        types = [t.type for t in gguf_index(path).tensors if t.name.startswith("blk.") and len(t.dims) == 2]
    except Exception:
        return False
    return bool(types) and sum(t in NATIVE_TYPES for t in types) * 2 > len(types)


def native_source(folder: Path, device="cpu") -> Path:
    """The GGUF file whose blocks a model of `folder` computes with at dtype gguf; refused (with
    what to use instead) on an accelerator, for a folder not converted from a GGUF, without the kernels."""
    if torch.device(device).type != "cpu":
        raise ModelLoadError("dtype 'gguf' is a CPU path; use bfloat16 on an accelerator")
    path = source_of(folder)
    if path is None:
        raise ModelLoadError(f"dtype 'gguf' needs a model loaded from a GGUF file; {folder} is not one "
                             "(use float32, bfloat16, int8 or int4 for a Hugging Face folder)")
    kernels()
    return path


def place_native_(model: nn.Module, path: Path) -> None:
    """Fill `model` (built on the meta device from its folder's config.json) with the GGUF
    file's own blocks at `path`: every linear a GGUFLinear. The loader finishes it."""
    from forerun.gguf.convert import _architecture
    from forerun.gguf.index import gguf_index

    index = gguf_index(path)  # (GGUFReader's parse, once per file version: cached)
    arch = _architecture({"general.architecture": index.architecture}, path)
    _place(model, _read_tensors(index, arch, model.config, path), model.config, path)


def _read_tensors(index, arch, cfg, path: Path) -> dict[str, Blocks | torch.Tensor]:
    """HF name -> Blocks (a matrix of a native type) or a float32 tensor (everything else)."""
    from forerun.gguf.convert import dequantize_bytes, hf_tensor_name, unpermute_rope_rows

    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    out: dict[str, Blocks | torch.Tensor] = {}
    for tensor in index.tensors:
        name = hf_tensor_name(tensor.name, arch.layer_names, arch.biased)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} for a {cfg.model_type} model")
        kind = tensor.name.split(".")[-2]
        t = tensor.type
        if t in NATIVE_TYPES and len(tensor.dims) == 2:
            K, rows = tensor.dims  # GGUF lists dims fastest-first
            qk, nbytes = NATIVE_TYPES[t]
            data = _read_bytes(path, tensor.offset, rows * (K // qk * nbytes)).reshape(rows, K // qk * nbytes)
            if arch.rope_rows_permuted and kind in heads:
                data = unpermute_rope_rows(data, heads[kind])
            out[name] = Blocks(torch.from_numpy(np.ascontiguousarray(data)), t, K)
            continue
        values = dequantize_bytes(_read_bytes(path, tensor.offset, tensor.nbytes), t, tensor.dims, tensor.name, path)
        if arch.rope_rows_permuted and kind in heads:
            values = unpermute_rope_rows(values, heads[kind])
        if arch.norm_shift and kind.endswith("norm"):
            values = values - np.float32(arch.norm_shift)
        out[name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
    return out


def _read_bytes(path: Path, offset: int, n: int) -> np.ndarray:
    """n bytes of the file from `offset`, read into memory of their own: not a view of the
    reader's mapping, whose touched pages count as resident beside every copy made from them
    (the 1.5B's load: 3.6 GB peak through the mapping, 2.4 GB read this way), and whose cold
    pages the kernel reclaims (see load_model)."""
    data = np.fromfile(path, dtype=np.uint8, count=n, offset=offset)
    if data.size != n:
        raise ModelLoadError(f"{path}: truncated file (a tensor's {n} bytes at offset {offset} run past its end)")
    return data


def _place(model: nn.Module, tensors: dict, cfg, path: Path) -> None:
    """Put every tensor where the model wants it: Blocks as GGUFLinear / GGUFEmbedding modules,
    the q/k/v and gate/up parts stacked, float tensors as parameters."""
    groups = getattr(model, "fused_linears", {})  # e.g. llama's qkv_proj <- q_proj, k_proj, v_proj
    used: set[str] = set()
    placed: list[str] = []  # modules built here, whole (their parameters are not in `rest`)
    for mod_name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            sources = next((tuple(mod_name[: -len(k)] + p for p in v) for k, v in groups.items() if mod_name.endswith(k)),
                           (mod_name,))
            if mod_name == "lm_head" and cfg.tie_word_embeddings:
                sources = ("model.embed_tokens",)
            set_module(model, mod_name, _linear(tensors, sources, module, used, path))
            placed.append(mod_name + ".")
        elif isinstance(module, nn.Embedding):
            set_module(model, mod_name, _embedding(tensors, mod_name, module, used, path))
            placed.append(mod_name + ".")
    if cfg.tie_word_embeddings:
        _share_tied_table(model)
    rest = {k: v for k, v in tensors.items() if k not in used}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("inv_freq") and not m.startswith(tuple(placed))]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: tensors do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _share_tied_table(model: nn.Module) -> None:
    """A tied head packed for the VNNI kernel holds a rearranged copy of the embedding's blocks:
    the embedding then looks its rows up in that copy (the same values, bit for bit), so the
    table is in memory once (Gemma 3 270M's Q8_0 table: 178 MB)."""
    head, emb = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if (isinstance(head, GGUFLinear) and type(emb) is GGUFEmbedding and len(head.parts) == 1
            and head.parts[0].packed_rows and head.parts[0].rows == emb.blocks.rows):
        emb.blocks = head.parts[0]


def _linear(tensors: dict, sources: tuple[str, ...], module: nn.Linear, used: set, path: Path) -> nn.Module:
    weights = [tensors.get(f"{s}.weight") for s in sources]
    if any(w is None for w in weights):
        raise ModelLoadError(f"{path}: GGUF lacks {[s for s, w in zip(sources, weights) if w is None][0]}.weight")
    biases = [tensors.get(f"{s}.bias") for s in sources]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    used.update(f"{s}.{k}" for s in sources for k in ("weight", "bias"))
    if all(isinstance(w, Blocks) for w in weights):
        linear = GGUFLinear(weights, bias)
    else:  # a float (or unsupported-type) part: this linear computes in float32, exactly
        from forerun.linears.f32 import F32RowsLinear

        full = torch.cat([w.dequantize() if isinstance(w, Blocks) else w for w in weights])
        plain = nn.Linear(full.shape[1], full.shape[0], bias=bias is not None, device="meta")
        plain.weight = nn.Parameter(full, requires_grad=False)
        if bias is not None:
            plain.bias = nn.Parameter(bias, requires_grad=False)
        linear = F32RowsLinear(plain, kernels())
    for s in sources:  # the linear holds its (maybe packed) copy: let the file's one go
        tensors.pop(f"{s}.weight", None)
    if (linear.out_features, linear.in_features) != (module.out_features, module.in_features):
        raise ModelLoadError(f"{path}: {sources[0]} is {linear.out_features} x {linear.in_features}, the config says "
                             f"{module.out_features} x {module.in_features}")
    return linear


def _embedding(tensors: dict, name: str, module: nn.Embedding, used: set, path: Path) -> nn.Module:
    w = tensors.get(f"{name}.weight")
    if w is None:
        raise ModelLoadError(f"{path}: GGUF lacks {name}.weight")
    used.add(f"{name}.weight")
    if isinstance(w, Blocks):
        return GGUFEmbedding(w)
    return nn.Embedding.from_pretrained(w)  # (frozen; no random init first)
