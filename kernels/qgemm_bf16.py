"""Block linears computed in bf16 over a bf16 copy of the weights (`kernels/cpu/qgemv.cpp`,
`bf16_linear_out`) and the twin.

For many rows of x (prefill, mixed steps, large decode batches) a block matmul is compute-bound,
and this CPU's bf16 GEMM (MKL over AMX or AVX512-BF16) runs ~4x its float32 one. The weight
blocks (layout in `kernels.qgemv`) are dequantized exactly and rounded to bf16 once
(`runtime.quant.blocks.BlockLinear` keeps the copy while the engine is busy), then multiplied
with x rounded to bf16; sums stay float32. That is vLLM's CPU default precision (bf16 weights and
activations); the cost against float32 is measured in
ops/bench/RESULTS.md#gguf-activation-quality. The op exists where torch's BLAS has the bf16 GEMM
(`bf16_gemm_available`); elsewhere the twin runs.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu_ops import native


@functools.cache
def bf16_gemm_available() -> bool:
    """Whether the bf16 op is built and torch's BLAS exports a bf16 GEMM."""
    return native() is not None and bool(torch.ops.tessera.cpu_bf16_gemm())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


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
