"""The W4A16 linear over INT4 weights in the GPU tile layout (`kernels/triton/int4_layout.py`:
codes K-major `qt` [K/2, N], scales `d` [G, N], offsets none / uint8 zero points / an m plane)
as the tessera op `w4a16_linear`; `ref_w4a16_linear` is its twin. The CUDA kernel is
`kernels/triton/w4a16.py` (registered by `kernels/triton/cuda_ops.py`)."""

from __future__ import annotations

import torch

from kernels.triton.int4_layout import Int4Tiles

HALF_ACTIVATIONS = (torch.bfloat16, torch.float16)


def w4a16_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: bf16 / fp16 as given, anything else rounded to bf16."""
    return x if x.dtype in HALF_ACTIVATIONS else x.to(torch.bfloat16)


def ref_w4a16_linear(x: torch.Tensor, qt: torch.Tensor, d: torch.Tensor,
                     offset: torch.Tensor | None, offset_kind: int,
                     group_size: int) -> torch.Tensor:
    """Twin: x [M, K] (float32 rounded to bf16 first, as the kernel reads it) -> [M, N] in x's
    dtype = x @ W^T with W `Int4Tiles.dequantize` (exact in fp32), sums in fp32."""
    w = Int4Tiles(qt, d, offset, offset_kind, group_size).dequantize()
    return (w4a16_activations(x).float() @ w.t()).to(x.dtype)
