"""int4 linears for the CPU: 4.5 bits a weight, int8 activations per block.

Why: a decode step streams every weight once, so on a memory-bound CPU its cost follows
the bytes per weight. int4 here is 4.5 bits against 8 for int8: the drafter and the
verifier both get cheaper, and the drafter's cost is what decides whether speculation pays.

Two forms, the same 4.5 bits:
- A linear whose inputs are whole blocks of 256 becomes GGUF Q4_K blocks (int4_linear): per
  sub-block of 32 inputs a grid w = (d sc) u - (dmin mn), u in 0..15, sc and mn 6-bit, d and
  dmin float16 per 256, fitted to the weights (int4_fit_rows.cpp: each sub-block's
  least-squares line, then the 6-bit pair with the least error), and computed by the gguf
  kernels (linears/gguf.py's GGUFLinear: activations int8 per 256, one instruction sequence for
  any number of tokens). From a quantized GGUF (int4_of_blocks) the file's own Q4_K matrices
  are kept byte for byte: only its other types (Q6_K, Q5_0, Q8_0 ...) are fitted. On the
  Qwen2.5-Coder-1.5B Q4_K_M: KL from float32 0.0083, perplexity +1.04% (every matrix fitted:
  0.011 / +1.16%; groups of 64: 0.025 / +2.92%; `forerun quality`, README).
- Any other (Qwen2.5-0.5B's 896-wide inputs) keeps int4's groups of 64 (Int4Linear): per
  output row and group w = d u + m, d and m float16, fitted the same way from a few starting
  grids, the min-max one among them; activations int8 with one scale per group of 64 (as
  llama.cpp's Q8 blocks: one scale per token let a few large channels flatten the rest);
  kernel int4_rows.cpp, one instruction sequence for any number of tokens.
Either way int4 speculative decoding reproduces int4 plain decoding bit for bit
(tests/test_int4.py). There is no fallback: without the compiled kernels, int4 is refused at
load time with the reason.
"""
from __future__ import annotations

import torch
from torch import nn

from forerun.kernels import loader as kernel_loader
from forerun.linears.swap import swap_linears

GROUP = 64  # inputs per scale / minimum
Q4K_WIDTH = 256  # inputs per Q4_K block: a linear with whole blocks of them takes that form


def _kernels():
    """forerun's compiled kernels (fits and int4_rows), or the refusal: int4 has no fallback."""
    kernel = kernel_loader.load()
    if kernel is None or not hasattr(kernel, "int4_fit_q4k"):
        raise RuntimeError("int4 needs forerun's compiled kernels, which could not be built here "
                           "(see the warning above); use float32")
    return kernel


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, K] float -> u [M, Kp] uint8 in 0..15, d and m [M, Kp/64] float16 (K padded with
    zero weights up to Kp, a multiple of 64: u = 0 there, never fitted). Each group's grid is
    fitted to its values by least squares, never worse than the min-max grid and equal to it
    on weights already on such a grid (int4_fit_rows.cpp)."""
    u, d, m = _kernels().int4_fit_groups(w.detach().float().contiguous())
    return u, d, m


def dequantize_groups(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, K: int) -> torch.Tensor:
    """The weights int4 computes with: [M, K] float32 (for references and reduced heads)."""
    M, Kp = u.shape
    w = u.view(M, Kp // GROUP, GROUP).float() * d.float().unsqueeze(2) + m.float().unsqueeze(2)
    return w.view(M, Kp)[:, :K].contiguous()  # (padding inputs: u = 0 there, but m may not be)


def pack_int4(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """-> (w [Mp/16, G, 8, 64] uint8, d and m [Mp/16, G, 16] float16), the
    layout int4_rows.cpp reads (Mp: M up to a multiple of 32, the kernel's 2-block chunks; zero rows). Byte 4l + j of
    vector i of group g: u[l, 64g + 8i + j] in the low nibble, u[l, 64g + 8i + 4 + j] high."""
    M, Kp = u.shape
    G, Mp = Kp // GROUP, -(-M // 32) * 32
    up = torch.zeros(Mp, Kp, dtype=torch.uint8)
    up[:M] = u
    dp, mp = torch.zeros(Mp, G, dtype=torch.float16), torch.zeros(Mp, G, dtype=torch.float16)
    dp[:M], mp[:M] = d, m
    quads = up.view(Mp // 16, 16, G, 8, 2, 4)  # [block, lane, group, vector, half, j]
    packed = quads[:, :, :, :, 0] | (quads[:, :, :, :, 1] << 4)  # [block, lane, group, vector, j]
    w = packed.permute(0, 2, 3, 1, 4).contiguous().view(Mp // 16, G, 8, 64)
    blocked = lambda t: t.view(Mp // 16, 16, G).transpose(1, 2).contiguous()  # noqa: E731
    return w, blocked(dp), blocked(mp)


def unpack_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """pack_int4's w -> u [len(ids), Kp] 0..15 of the given output rows (its inverse on them;
    only their 16-row blocks are read)."""
    blocks, G = w.shape[0], w.shape[1]
    lanes = w.view(blocks, G, 8, 16, 4)[ids // 16, :, :, ids % 16]  # [n, G, 8, 4]: row id's bytes
    halves = torch.stack([lanes & 15, lanes >> 4], dim=3)  # [n, G, 8, 2, 4] (low nibble first)
    return halves.view(len(ids), G * GROUP)


class Int4Linear(nn.Module):
    """nn.Linear's function at 4.5 bits a weight, through forerun's compiled kernel."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        u, d, m = quantize_groups(linear.weight.detach().float())
        self.register_buffer("weight_d", d, persistent=False)  # [out, Kp/64]
        self.register_buffer("weight_m", m, persistent=False)  # [out, Kp/64]
        # The 4-bit weights are held packed only (half a byte each; u4_rows unpacks rows on demand).
        self._packed = pack_int4(u, d, m)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.pre_norm = None  # an RMSNorm run first (see absorb_norm)
        self._build()

    def _build(self):
        self._kernel = _kernels()
        self._bind()

    def u4_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[len(ids) or out, Kp] uint8 0..15: the 4-bit weights of the given output rows (all by default)."""
        if ids is None:
            ids = torch.arange(self.out_features)
        return unpack_rows(self._packed[0], ids)

    def _bind(self):
        """As Int8Linear._bind: the kernel call, its arguments bound once in C++."""
        empty = torch.empty(0)
        bias = self.bias.data if self.bias is not None else empty
        norm_w, eps = (self.pre_norm.weight.data, self.pre_norm.eps) if self.pre_norm is not None else (empty, 0.0)
        self.kernel_linear = self._kernel.KernelLinear(True, *self._packed, bias, norm_w, eps, self.out_features)

    def __getstate__(self):  # deepcopy / pickle: drop the kernel handles (the packed weights are tensors)...
        return {**self.__dict__, "_kernel": None, "kernel_linear": None}

    def __setstate__(self, state):  # ...and bind them again
        super().__setstate__(state)
        self._build()

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] float32: the weights this linear computes with (a copy)."""
        return dequantize_groups(self.u4_rows(), self.weight_d, self.weight_m, self.in_features)

    def absorb_norm(self, norm: nn.Module) -> bool:
        """As Int8Linear.absorb_norm: linear(norm(x)) in one kernel call."""
        if type(norm).__name__ != "RMSNorm" or norm.weight.dtype != torch.float32:
            return False
        self.pre_norm = norm
        self._bind()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.kernel_linear(x if dtype == torch.float32 else x.float())
        return y if dtype == torch.float32 else y.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, 4-bit weights in groups of {GROUP}, forerun kernel"


def int4_linear(linear: nn.Module) -> nn.Module:
    """A float linear's int4 form: where its inputs are whole blocks of 256, GGUF Q4_K blocks
    fitted to its weights (int4_fit_q4k: the same 4.5 bits as a group of 64, but a grid per 32
    inputs with 6-bit scales), computed by the gguf kernels (GGUFLinear); else Int4Linear's
    groups of 64."""
    if linear.in_features % Q4K_WIDTH:
        return Int4Linear(linear)
    from forerun.linears.gguf import Q4_K, Blocks, GGUFLinear

    blocks = _kernels().int4_fit_q4k(linear.weight.detach().float().contiguous())
    bias = None if linear.bias is None else linear.bias.detach()
    return GGUFLinear([Blocks(blocks, Q4_K, linear.in_features)], bias)


def int4_of_blocks(linear: nn.Module) -> nn.Module:
    """int4 of a GGUFLinear (a quantized GGUF's matrix): its Q4_K parts kept as the file stores
    them (already int4's form: never re-quantized), any other part fitted to Q4_K blocks from
    its dequantized values; a linear whose inputs are not whole blocks of 256 as int4_linear."""
    from forerun.linears.gguf import Q4_K, Blocks, GGUFLinear

    if linear.in_features % Q4K_WIDTH:
        return int4_linear(linear)
    if all(p.type == Q4_K for p in linear.parts):
        return linear
    kernel = _kernels()
    parts = [p if p.type == Q4_K else Blocks(kernel.int4_fit_q4k(p.dequantize()), Q4_K, p.in_features)
             for p in linear.parts]
    return GGUFLinear(parts, None if linear.bias is None else linear.bias.detach())


def to_int4_(model: nn.Module) -> nn.Module:
    """The int4 model: every linear (the LM head included) 4-bit, then the model's own kernel
    wiring where it has one (norms folded into the linears they feed, per-query attention)."""
    from forerun.linears.int8 import finish_on_kernels_

    swap_linears(model, _int4_of)
    return finish_on_kernels_(model)


def _int4_of(child: nn.Module) -> nn.Module | None:
    """swap_linears' rule for int4: a float or float32-kernel linear, or an Int8Linear."""
    from forerun.linears.f32 import F32RowsLinear
    from forerun.linears.int8 import Int8Linear

    if isinstance(child, (nn.Linear, F32RowsLinear)):
        return int4_linear(child)
    if isinstance(child, Int8Linear):  # an int4 copy of an int8 model: from its dequantised weights
        q = int4_linear(_as_linear(child))
        if child.pre_norm is not None:  # (the layer's own norm call is gone: keep it here)
            q.absorb_norm(child.pre_norm)
        return q
    return None


def _as_linear(q) -> nn.Linear:
    """An Int8Linear's function as a float nn.Linear (scale x int8 rows; norms folded later)."""
    lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device="meta")
    lin.weight = nn.Parameter(q.weight_int8.float() * q.weight_scale[:, None], requires_grad=False)
    if q.bias is not None:
        lin.bias = nn.Parameter(q.bias.detach().clone(), requires_grad=False)
    return lin
