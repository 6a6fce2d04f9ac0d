"""The orthonormal Walsh-Hadamard rotation FP8 KV pages are stored in.

A per-(token, head) e4m3 scale is set by the row's largest element, and e4m3 keeps ~4
significant bits of every element, so the error of q.k is dominated by the few channels
where both q and k are large (RoPE pairs and the "massive activation" channels of attention
sinks). Rotating q and k by the same orthonormal H leaves q.k unchanged, (qH)(kH)^T = qk^T,
and spreads every channel's energy over all of them, so no product term carries the error
alone; V is rotated before storage and the attention output rotated back (H is symmetric
and its own inverse). The method is QuaRot's online Hadamard on K and V (Ashkboos et al.,
"QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", 2024, sec. 4; SpinQuant, Liu et al.
2024, uses the same online R3/R4 Hadamards for its KV cache): no calibration, no extra bytes.

The transform is the fast (Sylvester-ordered) butterfly, log2(dim) stages of (a + b, a - b)
then one multiply by 1/sqrt(dim), in float32: the C++ ops (`kernels/cpu/rows.h`) run the same
stages in the same order, so the store path is bit for bit its torch twin. Only power-of-two
head sizes are rotated (`kv_rotation_applies`); others store the plain vector.
"""

from __future__ import annotations

import math

import torch


def kv_rotation_applies(head_dim: int) -> bool:
    """Whether FP8 KV pages of this head size hold the rotated vector (power of two, >= 2)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x: [..., dim] float32, dim a power of two -> x @ H, H = Sylvester Hadamard / sqrt(dim).

    Applying it twice returns x (up to float rounding). Raises ValueError for other sizes."""
    dim = x.shape[-1]
    if not kv_rotation_applies(dim):
        raise ValueError(f"the Hadamard rotation needs a power-of-two size, got {dim}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, dim)
    h = 1
    while h < dim:
        pairs = y.view(-1, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, dim)
        h *= 2
    return y.mul_(1.0 / math.sqrt(dim)).view(*lead, dim)


def hadamard_matrix(dim: int) -> torch.Tensor:
    """The [dim, dim] float32 matrix `fwht` multiplies by (symmetric, orthonormal)."""
    return fwht(torch.eye(dim))
