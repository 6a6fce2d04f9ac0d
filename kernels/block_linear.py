"""The block linear: one op, `block_linear_out`, that chooses the kernel for weights in the
32-weight block layout (`kernels.qgemv`): int8-limb activations (`kernels.qgemv_i8`) at every
row count when `limbs` > 0 (so a row's bits never depend on the batch: docs/DESIGN.md, batch
invariance), else float32 activations (`kernels.qgemv`: register tiles,
past 16 rows dequantized tiles and BLAS). Q8 planes have int8 `qs`, Q4 planes uint8. The module
(`runtime.quant.blocks.BlockPlanes.linear`) and the fused decode step
(`kernels/cpu/decode_llama.cpp`) both call it, so the choice is made once, in
`kernels/cpu/qgemv.cpp`; `ref_block_linear` is its twin.
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import native_ops
from kernels.qgemv import ref_q4_linear, ref_q8_linear
from kernels.qgemv_i8 import int8_kernels_available, ref_q4_linear_i8, ref_q8_linear_i8


def ref_block_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                     zeros: torch.Tensor | None, group_size: int, limbs: int) -> torch.Tensor:
    """Twin of `block_linear_out`: x float32 [M, K] -> float32 [M, N]."""
    i8 = limbs > 0
    if qs.dtype == torch.int8:
        return ref_q8_linear_i8(x, qs, d, limbs) if i8 else ref_q8_linear(x, qs, d)
    if i8:
        if m is None or zeros is not None or group_size != 32:
            raise RuntimeError("int8 activations need Q4 planes with offsets (m) in groups of 32")
        return ref_q4_linear_i8(x, qs, d, m, limbs)
    return ref_q4_linear(x, qs, d, m, group_size, zeros)


def block_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
                 zeros: torch.Tensor | None = None, group_size: int = 32,
                 limbs: int = 0) -> torch.Tensor:
    """x float32 [..., K] -> float32 [..., N] over Q4 (`qs` uint8; offsets from `m`, `zeros` or
    neither, as `kernels.qgemv.q4_offsets` says) or Q8 (`qs` int8) blocks, through
    `block_linear_out`; `limbs` (0, 1 or 2) int8 limbs of x at every row count.
    Where the CPU build has no int8 kernels (no AVX-512 VNNI), int8 limbs run the twin. Raises
    RuntimeError on shapes or dtypes the layout forbids, ValueError for another number of
    limbs."""
    if limbs not in (0, 1, 2):
        raise ValueError(f"limbs must be 0, 1 or 2, got {limbs}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if limbs and not int8_kernels_available():
        y = ref_block_linear(x2, qs, d, m, zeros, group_size, limbs)
    else:
        y = x2.new_empty(x2.shape[0], qs.shape[0])
        native_ops().block_linear_out(x2, qs, d, m, zeros, group_size, limbs, y)
    return y.view(*x.shape[:-1], qs.shape[0])
