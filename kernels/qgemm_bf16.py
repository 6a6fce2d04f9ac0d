"""Block linear layers computed in bf16 (`kernels/cpu/qgemv.cpp`, `gemm_bf16`) and their twins.

For many rows of x (prefill, mixed steps, large decode batches) a block matmul is compute-bound,
and this CPU's bf16 GEMM (MKL over AMX or AVX512-BF16) runs ~4x its float32 one. Tiles of the
weight blocks (layout in `kernels.qgemv`) are dequantized exactly, rounded to bf16 (nearest
even), and multiplied with x rounded to bf16; sums stay float32. That is vLLM's CPU default
precision (bf16 weights and activations); the cost against float32 is measured in
ops/bench/RESULTS.md#gguf-activation-quality. The ops exist where torch's BLAS has the bf16 GEMM
(`bf16_gemm_available`); elsewhere the twins run.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_ops import native
from kernels.qgemv import ref_q4_dequantize, ref_q8_dequantize


@functools.cache
def bf16_gemm_available() -> bool:
    """Whether the bf16 block ops are built and torch's BLAS exports a bf16 GEMM."""
    return native() is not None and bool(torch.ops.tessera.cpu_bf16_gemm())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def ref_q4_linear_bf16(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                       m: torch.Tensor | None, group_size: int,
                       zeros: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: x float32 [M, K] -> float32 [M, N] = bf16(x) @ bf16(W)^T, sums in float64."""
    w = _bf16(ref_q4_dequantize(qs, d, m, group_size, zeros))
    return (_bf16(x).double() @ w.double().t()).float()


def ref_q8_linear_bf16(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Twin of the Q8 op, as `ref_q4_linear_bf16`."""
    w = _bf16(ref_q8_dequantize(qs, d))
    return (_bf16(x).double() @ w.double().t()).float()


def q4_linear_bf16(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                   group_size: int, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [..., K] -> float32 [..., N] over Q4 blocks, computed in bf16; the C++ op where
    available, else the twin. Raises RuntimeError on shapes or dtypes the layout forbids."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not bf16_gemm_available():
        y = ref_q4_linear_bf16(x2, qs, d, m, group_size, zeros)
    else:
        y = x2.new_empty(x2.shape[0], qs.shape[0])
        torch.ops.tessera.q4_linear_bf16_out(x2, qs, d, m, zeros, group_size, y)
    return y.view(*x.shape[:-1], qs.shape[0])


def q8_linear_bf16(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x float32 [..., K] -> float32 [..., N] over Q8 blocks, computed in bf16; as above."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not bf16_gemm_available():
        y = ref_q8_linear_bf16(x2, qs, d)
    else:
        y = x2.new_empty(x2.shape[0], qs.shape[0])
        torch.ops.tessera.q8_linear_bf16_out(x2, qs, d, y)
    return y.view(*x.shape[:-1], qs.shape[0])


def ref_bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin of `bf16_linear`: float32 [M, N] = bf16(x) @ w^T, sums in float64."""
    return (_bf16(x).double() @ w.double().t()).float()


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x float32 [..., K], w bfloat16 [N, K] (a dequantized copy of blocks) -> float32 [..., N]:
    x rounded to bf16, float32 sums and output (torch's bf16 F.linear would round y too)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if not bf16_gemm_available():
        y = ref_bf16_linear(x2, w)
    else:
        y = x2.new_empty(x2.shape[0], w.shape[0])
        torch.ops.tessera.bf16_linear_out(x2, w, y)
    return y.view(*x.shape[:-1], w.shape[0])
