"""FP8 e4m3 weights: one fp32 scale per output channel, or per 128x128 block as DeepSeek-V3
and Kimi-K2 ship them.

The scale rule, FP8_MAX and the e4m3 decode are the KV format's (`kernels/fp8.py`): one
definition, so weights and KV round the same way.

Block scales follow DeepSeek-V3's released FP8 checkpoints (and Hugging Face's
`FineGrainedFP8Config`): `weight` is e4m3 [out, in], `weight_scale_inv` is float32
[ceil(out / 128), ceil(in / 128)], and the weight is `weight * weight_scale_inv` over each
block (the name says "inverse" of the quantization scale; it is the dequantization
multiplier). Edge blocks are partial. In memory a block-scaled layer keeps one scale per
(output row, 128-column block), `expand_block_rows`, so fused projections (q/k/v, gate/up)
whose row counts are not multiples of 128 concatenate exactly.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, fp8_scale

DEFAULT_BLOCK = (128, 128)


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [out, in] -> (fp8 [out, in], fp32 scales [out])
    scale = fp8_scale(w.abs().amax(dim=1), torch.float32)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_per_channel(q: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (e4m3 [out, in], weight_scale_inv fp32 [ceil(out/bo), ceil(in/bi)]),
    each block scaled so its amax lands on 448 (DeepSeek-V3's `weight_block_size` layout)."""
    out_dim, in_dim = w.shape
    bo, bi = block
    scale_inv = fp8_scale(_block_amax(w.float().abs(), block), torch.float32)
    full = scale_inv.repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def expand_block_rows(scale_inv: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """[ceil(rows/block_rows), col_blocks] -> [rows, col_blocks]: one scale per row and block."""
    return scale_inv.repeat_interleave(block_rows, 0)[:rows].contiguous()


def dequantize_fp8_row_blocks(q: torch.Tensor, scale: torch.Tensor, block_cols: int,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [out, in] e4m3; scale: [out, ceil(in/block_cols)] -> [out, in] in `dtype`."""
    full = scale.float().repeat_interleave(block_cols, 1)[:, : q.shape[1]]
    return (q.to(torch.float32) * full).to(dtype)


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bo, bi = block
    out_dim, in_dim = x.shape
    padded = torch.nn.functional.pad(x, (0, -in_dim % bi, 0, -out_dim % bo))
    rows, cols = padded.shape[0] // bo, padded.shape[1] // bi
    return padded.view(rows, bo, cols, bi).amax(dim=(1, 3))
