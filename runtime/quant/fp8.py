"""FP8 e4m3 weights: one fp32 scale per output channel.

The scale rule, FP8_MAX and the e4m3 decode are the KV format's (`kernels/fp8.py`): one
definition, so weights and KV round the same way.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, fp8_scale


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [out, in] -> (fp8 [out, in], fp32 scales [out])
    scale = fp8_scale(w.abs().amax(dim=1), torch.float32)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_per_channel(q: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)
