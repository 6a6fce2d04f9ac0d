"""SwiGLU's activation in one op (`kernels/cpu/activation.cpp` on CPU) and its torch twin.

    gate, up = gate_up.chunk(2, -1)
    out = silu(gate) * up

One pass over the gate_up projection's output instead of torch's strided silu, then a multiply
into a third tensor: a 128-token prefill spends ~4% of its time there (ops/bench/RESULTS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_ops import native_ops


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate first, as the fused projection stores it) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As `ref_silu_mul`; the `silu_mul` op for contiguous 2-d float32 tensors. Its CPU kernel's
    exp is a polynomial (relative error ~2e-7, `kernels/cpu/rows.h`), so it matches the twin to
    float32 rounding, not bit for bit; each element's result depends on its value alone."""
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return ref_silu_mul(gate_up)
    return native_ops().silu_mul(gate_up)
