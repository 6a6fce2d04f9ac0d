"""Block linear layers with int8 activations (`kernels/cpu/qgemv_i8.cpp`) and their twins.

x is quantized per row and per block of 32 to int8 with one float32 scale, as llama.cpp's
Q8_1 does: dx = amax / 127, xq = round-half-even(x * (127 / amax)) (all zero for an all-zero
block). Then, for Q4 planes (GGUF Q4_0/Q4_1: group 32, float16 d and m, layout in
`kernels.qgemv`), y = sum_b d_b dx_b dot(q_b, xq_b) + m_b dx_b sum(xq_b); for Q8 planes,
y = sum_b d_b dx_b dot(w_b, xq_b). The integer dots are exact, so the kernel and the twins
differ only in the order of the float32 sums; against the float32-activation kernel the
difference is x's rounding to int8 (measured in
ops/bench/RESULTS.md#gguf-activation-quality).
With `limbs=2` x is carried as two int8 limbs per block: xq as above, then the rounding
residual r = x - dx xq (each element rounded once) quantized the same way, and every block dot
is taken over both (dx dot(w, xq) + dx2 dot(w, xq2)): x is held to ~1.6e-5 of its block's amax
instead of ~4e-3, for about 1.4x the one-limb kernel's time, still ~2x faster than the float32
kernel at decode (ops/bench/RESULTS.md#weight-kernels).
The C++ ops exist only where the CPU has AVX-512 VNNI (`int8_kernels_available`).
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_ops import native
from kernels.qgemv import BLOCK, unpack_q4_blocks


@functools.cache
def int8_kernels_available() -> bool:
    """Whether the int8-activation C++ ops are built (x86-64 with AVX-512 VNNI)."""
    return native() is not None and bool(torch.ops.tessera.cpu_int8_kernels())


def ref_quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] (K a multiple of 32) -> (xq int8 [M, K], dx float32 [M, K/32]),
    rounded exactly as the C++ op rounds (float32 127 / amax, product, half to even)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    xq = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return xq.reshape(m, k), amax / 127.0


def ref_quantize_limbs(x: torch.Tensor, limbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x float32 [M, K] -> `limbs` (xq, dx) pairs: x's own, then (limbs=2) its residual
    r = x - dx xq, rounded once to float32 as the C++ op's fused multiply-subtract does."""
    if limbs not in (1, 2):
        raise ValueError(f"limbs must be 1 or 2, got {limbs}")
    out = [ref_quantize_rows_q8(x)]
    if limbs == 2:
        xq, dx = out[0]
        scale = dx.double().repeat_interleave(BLOCK, dim=1)
        residual = (x.double() - scale * xq.double()).float()  # exact in float64, then rounded
        out.append(ref_quantize_rows_q8(residual))
    return out


def _block_dots(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq [M, K], w [N, K] integer-valued -> exact per-block dots float64 [M, N, K/32]."""
    m, k = xq.shape
    xb = xq.double().reshape(m, k // BLOCK, BLOCK)
    wb = w.double().reshape(w.shape[0], k // BLOCK, BLOCK)
    return torch.einsum("mbj,nbj->mnb", xb, wb)


def ref_q4_linear_i8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                     m: torch.Tensor, limbs: int = 1) -> torch.Tensor:
    """Twin of the Q4 op: x float32 [M, K] -> float32 [M, N], sums in float64."""
    codes = unpack_q4_blocks(qs)
    y = torch.zeros(x.shape[0], qs.shape[0], dtype=torch.float64)
    for xq, dx in ref_quantize_limbs(x, limbs):
        dots = _block_dots(xq, codes)
        sums = xq.double().reshape(xq.shape[0], -1, BLOCK).sum(-1)  # [M, K/32]
        y += (dots * d.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1)
        y += ((sums * dx.double()).unsqueeze(1) * m.double().unsqueeze(0)).sum(-1)
    return y.float()


def ref_q8_linear_i8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                     limbs: int = 1) -> torch.Tensor:
    """Twin of the Q8 op: x float32 [M, K] -> float32 [M, N], sums in float64."""
    y = torch.zeros(x.shape[0], qs.shape[0], dtype=torch.float64)
    for xq, dx in ref_quantize_limbs(x, limbs):
        dots = _block_dots(xq, qs)
        y += (dots * d.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1)
    return y.float()


def q4_linear_i8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 out: torch.Tensor | None = None, limbs: int = 1) -> torch.Tensor:
    """x float32 [..., K] -> [..., N] over Q4 planes (group 32, float16 d and m), x in
    `limbs` (1 or 2) int8 limbs; the C++ op where built, else the twin. `out` (float32
    [rows, N], contiguous) is written in full when given. Raises RuntimeError on shapes or
    dtypes the layout forbids, ValueError for another number of limbs."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not int8_kernels_available():
        y = ref_q4_linear_i8(x2, qs, d, m, limbs)
        return (y if out is None else out.copy_(y)).view(*x.shape[:-1], qs.shape[0])
    if limbs not in (1, 2):
        raise ValueError(f"limbs must be 1 or 2, got {limbs}")
    y = x2.new_empty(x2.shape[0], qs.shape[0]) if out is None else out
    torch.ops.tessera.q4_linear_i8_out(x2, qs, d, m, y, limbs)
    return y.view(*x.shape[:-1], qs.shape[0])


def q8_linear_i8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                 out: torch.Tensor | None = None, limbs: int = 1) -> torch.Tensor:
    """x float32 [..., K] -> [..., N] over Q8 planes, x in int8 limbs; as `q4_linear_i8`."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not int8_kernels_available():
        y = ref_q8_linear_i8(x2, qs, d, limbs)
        return (y if out is None else out.copy_(y)).view(*x.shape[:-1], qs.shape[0])
    if limbs not in (1, 2):
        raise ValueError(f"limbs must be 1 or 2, got {limbs}")
    y = x2.new_empty(x2.shape[0], qs.shape[0]) if out is None else out
    torch.ops.tessera.q8_linear_i8_out(x2, qs, d, y, limbs)
    return y.view(*x.shape[:-1], qs.shape[0])
