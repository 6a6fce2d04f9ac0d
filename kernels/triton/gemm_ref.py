"""torch twins of the Triton matmuls' quantizers (the test oracle): FP8 activation groups and
the dequantized block-FP8 weight. INT4's twin is `Int4Tiles.dequantize`."""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, fp8_scale

FP8_GROUP = 128  # DeepSeek-V3: 1 x 128 activation groups, 128 x 128 weight blocks


def ref_quant_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 bytes uint8 [M, K], fp32 scales [M, ceil(K / group)]): per row and
    group s = fp8_scale(amax), q = e4m3(clamp(x / s, +-448)); NaN -> 0, +-inf -> +-fp32 max
    (`quant_fp8_groups_kernel` does the same)."""
    m, k = x.shape
    big = torch.finfo(torch.float32).max
    xf = torch.nan_to_num(x.float(), nan=0.0, posinf=big, neginf=-big)
    padded = torch.nn.functional.pad(xf, (0, -k % group)).view(m, -1, group)
    scale = fp8_scale(padded.abs().amax(dim=-1), torch.float32)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(m, -1)[:, :k].contiguous(), scale


def ref_dequant_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, scale_rows: int,
                           group: int = FP8_GROUP) -> torch.Tensor:
    """e4m3 bytes (uint8 or float8_e4m3fn) [R, K] with scale [ceil(R / scale_rows),
    ceil(K / group)] -> float32 [R, K] (scale_rows 1: activations or per-row weight scales;
    128: DeepSeek-V3's weight_scale_inv)."""
    r, k = q.shape
    values = q.view(torch.float8_e4m3fn).float()
    full = scale.float().repeat_interleave(scale_rows, 0)[:r].repeat_interleave(group, 1)
    return values * full[:, :k]
