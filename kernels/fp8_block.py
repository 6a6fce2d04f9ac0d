"""Block-scaled FP8 linear, W8A8 as DeepSeek-V3's checkpoints are served on GPUs (SGLang's
`w8a8_block_fp8_matmul`): x quantized to e4m3 per (row, 128 columns) with `fp8_scale`'s rule,
weights e4m3 with one fp32 scale per 128 x 128 block or per (row, 128 columns). The tessera op
`fp8_block_linear`; `ref_fp8_block_linear` is its twin, the CUDA kernel
`kernels/triton/fp8_block.py` (registered by `kernels/triton/cuda_ops.py`)."""

from __future__ import annotations

import torch

from kernels.triton.gemm_ref import FP8_GROUP, ref_dequant_fp8_blocks, ref_quant_fp8_groups


def weight_scale_rows(out_features: int, weight_scale: torch.Tensor) -> int:
    """Rows one weight scale covers: 128 for DeepSeek-V3's [ceil(N/128), ceil(K/128)]
    `weight_scale_inv`, 1 for tessera's expanded [N, ceil(K/128)] (the launcher's rule)."""
    return FP8_GROUP if weight_scale.shape[0] == -(-out_features // FP8_GROUP) else 1


def ref_fp8_block_linear(x: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    """Twin: x [M, K] float -> [M, N] in x's dtype = dequant(quant(x)) @ dequant(weight)^T in
    fp32. weight: e4m3 bytes uint8 [N, K]; weight_scale fp32 (see `weight_scale_rows`)."""
    q, s = ref_quant_fp8_groups(x)
    a = ref_dequant_fp8_blocks(q, s, 1)
    w = ref_dequant_fp8_blocks(weight, weight_scale, weight_scale_rows(weight.shape[0],
                                                                       weight_scale))
    return (a @ w.t()).to(x.dtype)
