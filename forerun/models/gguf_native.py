"""dtype "gguf": a model that computes with its GGUF file's own quantized blocks.

Why: every other precision changes the weights the user downloaded. float32 dequantizes the
file exactly but streams 4-8x the bytes; int8 / int4 re-quantize weights that were already
quantized (Qwen2.5-Coder-1.5B Q4_K_M: +0.19% / +1.04% perplexity since 2026-12-04; +1.7% / +4.6%
at first). Here every linear keeps the
file's blocks byte for byte (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; ggml's layouts,
gguf_rows.cpp) and the activations are quantized per block of the weight's width, as
llama.cpp does: the model llama.cpp runs, at its fidelity.

Weights are read once from the mapped file into memory (rows of a llama q/k projection put
back in Hugging Face's RoPE order: a reordering of whole rows, the bytes unchanged). Where the
kernels have AVX512-VNNI, every linear has its rows rearranged 16 per tile (gguf_packed_rows.cpp:
the same bits, 16 outputs per VNNI instruction); elsewhere, or with FORERUN_GGUF_ROWS=1, the
linears read the file's row-major blocks (gguf_rows.cpp). The
embedding table is read from its blocks too, one looked-up row at a time. Tensors of other
types (float norms and biases, a float or unsupported-type matrix) are dequantized to
float32 exactly as the float32 path does. Each token's output is one instruction sequence
whatever else is computed beside it, so `gguf` speculative decoding reproduces `gguf` plain
decoding bit for bit (tests/test_gguf_native.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from forerun.errors import ModelLoadError
from forerun.models import int8_kernel
from forerun.models.gguf_convert import source_of

# ggml type ids (gguf.GGMLQuantizationType) with a native kernel -> (values, bytes) per block.
NATIVE_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                12: (256, 144), 13: (256, 176), 14: (256, 210)}


# Types the packed kernel (gguf_packed_rows.cpp) rearranges 16 rows at a time: every native
# type. The bulk of a Q4_K_M file (Q4_K, and the Q6_K of its attn_v, ffn_down and output head),
# a Q5_K_M file's Q5_K, and the legacy 32-value types a file falls back to where a matrix's
# inputs are not whole blocks of 256 (Qwen2.5-0.5B's 896: Q5_0 / Q8_0; SmolLM2's 576: Q4_1).
Q4_K, Q6_K = 12, 14
PACKED_TYPES = set(NATIVE_TYPES)


@dataclass(frozen=True)
class Blocks:
    """One quantized matrix as the file stores it: data [rows, bytes per row] uint8, the
    blocks of each output row in input order; type a ggml type id in NATIVE_TYPES. Packed
    (`packed_rows` > 0): the same bytes rearranged 16 rows per tile, data [ceil(rows / 16),
    K / qk * tile-block bytes] (gguf_packed_rows.cpp), for the VNNI kernel."""

    data: torch.Tensor  # [rows, K / qk * bytes] uint8, or packed [ceil(rows / 16), ...]
    type: int
    in_features: int
    packed_rows: int = 0  # > 0: packed, with this many rows

    @property
    def rows(self) -> int:
        return self.packed_rows or self.data.shape[0]

    def select(self, ids: torch.Tensor) -> "Blocks":
        ids = ids.to(torch.long)
        if self.packed_rows:
            return Blocks(_kernel().gguf_packed_select(self.data, self.type, ids, self.in_features), self.type,
                          self.in_features, len(ids))
        return Blocks(self.data.index_select(0, ids).contiguous(), self.type, self.in_features)

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[len(ids) or rows, K] float32: the values the kernel computes with (ggml's dequantization)."""
        ids = (torch.arange(self.rows) if ids is None else ids).to(torch.long)
        if self.packed_rows:
            return _kernel().gguf_packed_dequant(self.data, self.type, ids, self.in_features)
        return _kernel().gguf_dequant_rows(self.data, self.type, ids, self.in_features)

    def pack(self) -> "Blocks":
        """These blocks packed for the VNNI kernel (the same bits, rearranged); itself if packed."""
        if self.packed_rows:
            return self
        return Blocks(_kernel().gguf_pack(self.data, self.type, self.in_features), self.type, self.in_features,
                      self.rows)


def packs(parts: list[Blocks]) -> bool:
    """Whether a linear of these parts runs on the packed kernel: all of a packed type and a
    kernel compiled with AVX512-VNNI (elsewhere the row kernel is faster than the packed one's
    plain C++)."""
    kernel = _kernel()
    return (hasattr(kernel, "gguf_packed_vnni") and kernel.gguf_packed_vnni() and not os.environ.get("FORERUN_GGUF_ROWS")
            and all(p.type in PACKED_TYPES for p in parts))


def _kernel():
    kernel = int8_kernel.load()
    if kernel is None or not hasattr(kernel, "gguf_rows"):
        raise ModelLoadError("dtype 'gguf' needs forerun's compiled kernels, which are not available here "
                             "(see the warning above; `make setup` builds them); use float32")
    return kernel


class GGUFLinear(nn.Module):
    """nn.Linear's function over GGUF blocks: parts stacked along the outputs (a fused q/k/v
    or gate/up may mix types, e.g. Q4_K q and k with a Q6_K v), one kernel call."""

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFLinear: parts with different input widths")
        self.pre_norm = None  # an RMSNorm run first (see absorb_norm)
        self.packed = packs(parts)
        self.parts = [p.pack() for p in parts] if self.packed else parts
        if not self.packed and any(p.packed_rows for p in parts):
            raise ValueError("GGUFLinear: packed blocks need the packed kernel (AVX512-VNNI) and packed types only")
        self.in_features, self.out_features = parts[0].in_features, sum(p.rows for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self._bind()

    def _bind(self):
        """The kernel call (gguf_packed_rows or gguf_rows, the absorbed RMSNorm first), its
        arguments bound once in C++ (KernelLinear): what forward and a decoder layer's one C++
        call (layer_rows.cpp) both run."""
        kernel, bias = _kernel(), self.bias.data if self.bias is not None else torch.empty(0)
        norm = self.pre_norm
        norm_w, eps = (norm.weight.data, float(norm.eps)) if norm is not None else (torch.empty(0), 0.0)
        self.kernel_linear = kernel.KernelLinear.gguf(self.packed, [p.data for p in self.parts],
                                                      [p.type for p in self.parts], [p.rows for p in self.parts],
                                                      bias, norm_w, eps)

    def absorb_norm(self, norm: nn.Module) -> bool:
        """Compute linear(norm(x)) from here on, the RMSNorm run by the kernels' rms_norm_rows
        just before this linear's kernel, both inside the one bound call (kernel_linear) that
        forward and the layer's C++ call use: the caller drops its own call to `norm`. False
        (nothing changed) for a norm other than a float32 RMSNorm (Gemma's keep theirs)."""
        if type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
            return False
        self.pre_norm = norm
        self._bind()
        return True

    def __getstate__(self):  # deepcopy / pickle: drop the compiled call...
        return {**self.__dict__, "kernel_linear": None}

    def __setstate__(self, state):  # ...and find it again
        super().__setstate__(state)
        self._bind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x if dtype == torch.float32 else x.float()
        y = self.kernel_linear(x)
        return y if dtype == torch.float32 else y.to(dtype)

    def float_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in] float32 weights of the given output rows."""
        out = torch.empty(len(ids), self.in_features)
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.rows)
            if mine.any():
                out[mine] = p.dequantize(ids[mine] - start)
            start += p.rows
        return out

    def select_rows(self, ids: torch.Tensor) -> "GGUFLinear":
        """A GGUFLinear of the given output rows (the same blocks): a reduced LM head."""
        if len(self.parts) != 1:
            raise ValueError("select_rows: a single-part GGUFLinear only")
        bias = None if self.bias is None else self.bias.data[ids]
        return GGUFLinear([self.parts[0].select(ids)], bias)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] float32, dequantized on demand (a copy: for building other models from this one)."""
        return self.float_rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        types = "+".join(_type_name(p.type) for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, GGUF {types} blocks, forerun kernel"


class GGUFEmbedding(nn.Module):
    """nn.Embedding over GGUF blocks: each looked-up row dequantized exactly when looked up."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.rows, blocks.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        try:  # the kernel checks every id: no passes over them here (two reductions a forward)
            rows = self.blocks.dequantize(ids.reshape(-1))
        except RuntimeError as e:
            if "out of range" not in str(e):
                raise
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows") from None
        return rows.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """[rows, dim] float32, dequantized on demand (a copy)."""
        return self.blocks.dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {_type_name(self.blocks.type)} blocks"


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t).name


# --- loading -----------------------------------------------------------------------------------


def quantized_source(folder: Path) -> bool:
    """Whether `folder` came from a GGUF whose projection matrices are mostly of native types
    (a float16 / float32 GGUF is served best at float32)."""
    path = source_of(folder)
    if path is None:
        return False
    from forerun.models.gguf_index import gguf_index

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
    _kernel()
    return path


def place_native_(model: nn.Module, path: Path) -> None:
    """Fill `model` (built on the meta device from its folder's config.json) with the GGUF
    file's own blocks at `path`: every linear a GGUFLinear. The loader finishes it."""
    from forerun.models.gguf_convert import _architecture
    from forerun.models.gguf_index import gguf_index

    index = gguf_index(path)  # (GGUFReader's parse, once per file version: cached)
    arch = _architecture({"general.architecture": index.architecture}, path)
    _place(model, _read_tensors(index, arch, model.config, path), model.config, path)


def _read_tensors(index, arch, cfg, path: Path) -> dict[str, Blocks | torch.Tensor]:
    """HF name -> Blocks (a matrix of a native type) or a float32 tensor (everything else)."""
    from forerun.models.gguf_convert import dequantize_bytes, hf_tensor_name, unpermute_rope_rows

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
    from forerun.models.llama import LlamaForCausalLM

    fused = isinstance(model, LlamaForCausalLM)
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")} if fused else {}
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
        from forerun.models.f32_linear import F32RowsLinear

        full = torch.cat([w.dequantize() if isinstance(w, Blocks) else w for w in weights])
        plain = nn.Linear(full.shape[1], full.shape[0], bias=bias is not None, device="meta")
        plain.weight = nn.Parameter(full, requires_grad=False)
        if bias is not None:
            plain.bias = nn.Parameter(bias, requires_grad=False)
        linear = F32RowsLinear(plain, _kernel())
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
    emb = nn.Embedding(w.shape[0], w.shape[1], device="meta")
    emb.weight = nn.Parameter(w, requires_grad=False)
    return emb


def set_module(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
