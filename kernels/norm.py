"""Residual add + RMSNorm in one op (`kernels/cpu/norm.cpp` on CPU) and its torch twin.

    x += delta            (in place, the residual stream; skipped when delta is None)
    out = x * rsqrt(mean(x^2, -1) + eps) * weight

A decoder layer runs two of these, each replacing an `add_` and torch's rms_norm (five ops):
per-op dispatch is most of a small op's cost at decode (issue 16,
ops/bench/RESULTS-log.md#int8-activations-fused-residual--rmsnorm-issue-16-kernel-helper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_ops import native_ops


def ref_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """x [..., n] (updated in place with delta), weight [n] -> normalized [..., n]."""
    if delta is not None:
        x.add_(delta)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """As `ref_add_rms_norm`; the `add_rms_norm` op for contiguous 2-d float32 tensors
    (float32 rounding apart, the same numbers: its mean sums in another order)."""
    if (x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous()
            or weight.dtype != torch.float32
            or (delta is not None and delta.dtype != torch.float32)):
        return ref_add_rms_norm(x, delta, weight, eps)
    return native_ops().add_rms_norm(x, delta, weight, eps)
