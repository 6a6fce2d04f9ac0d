"""Weight storage the CPU matmul reads fastest: float projections stored column-major.

`F.linear(x, W)` with W [out, in] stored row-major hands MKL's sgemm a transposed operand; at
the few rows a decode step has, that path ran up to 1.9x slower on the development machine than
the same product with W's storage laid out [in, out] (W then a transposed view of it): 16.4 vs
31.3 ms for the 49152x576 lm_head at 8 rows, 25.4 vs 28.0 at 32, 7.7 vs 8.3 at one row (one
thread, CPU time, 2026-12-01; `ops/bench/RESULTS-log.md`, "What the profile says"). Shapes,
values, parameter objects and tying stay as they were: only the strides change.
"""

from __future__ import annotations

import torch
from torch import nn


def is_column_major(weight: torch.Tensor) -> bool:
    """Whether a 2-d `weight` [out, in] is stored [in, out] contiguous (strides (1, out))."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def use_column_major_weights(model: nn.Module) -> int:
    """Re-store the weight of every float `nn.Linear` in `model` that lives on the CPU as
    [in, out] contiguous, in place (the `Parameter` keeps its identity, so a tied embedding
    follows: its row lookups then read strided, ~10 µs a token). Quantized modules and other
    devices (cuBLAS takes either layout at full speed) are left alone. Returns the bytes
    re-stored; a tensor shared by several modules is re-stored once."""
    moved = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if (weight.device.type != "cpu" or not weight.is_floating_point()
                or weight.dim() != 2 or is_column_major(weight)):
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        moved += weight.numel() * weight.element_size()
    return moved
