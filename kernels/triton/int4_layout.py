"""The GPU layout of INT4 group-wise weights (`kernels/triton/w4a16.py`), repacked once at load
from the forms tessera stores: its INT4 rows (`runtime/quant/linear.py` `Int4Linear`, layout
"rows": two codes a byte, low nibble first, zero points packed two a byte) and the Q4 block
planes of GGUF Q4_0 / Q4_1 (`kernels/qgemv.py`). torch only; runs on the weights' device.

Why repack: both stored forms are N-major ([N, K/2]), so one group of 32 weights is 16 bytes
of a row and a K-slice of a tile is half a 32-byte sector per row. K-major [K/2, N] makes a
group's tile GROUP/2 rows of BLOCK_N contiguous bytes (whole sectors, any tile width), and the
scales [groups, N] one contiguous vector per group. Within each 32 weights the nibble order
is the Q4 block order (byte j: weights j and j + 16), so from Q4 planes the repack is a
transpose. Same bytes as stored (plus zero points unpacked to a byte each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.qgemv import BLOCK, pack_q4_blocks, unpack_q4_blocks

OFFSET_SYMMETRIC, OFFSET_ZEROS, OFFSET_PLANE = 0, 1, 2
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Int4Tiles:
    """INT4 weights [N, K] in the kernel's layout: w[n, k] = d[g, n] * (q[n, k] - z[g, n]) with
    z = 8 (OFFSET_SYMMETRIC) or `offset` uint8 [G, N] (OFFSET_ZEROS); or d * q + m with `offset`
    the m plane [G, N] (OFFSET_PLANE, GGUF Q4_1). g = k // group_size; G = ceil(K / group_size)
    (the last group may be shorter). qt: uint8 [K/2, N] (module docstring); d: [G, N] bf16,
    fp16 or fp32."""

    qt: torch.Tensor
    d: torch.Tensor
    offset: torch.Tensor | None
    offset_kind: int
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qt.shape[0] * 2

    @property
    def out_features(self) -> int:
        return self.qt.shape[1]

    def codes(self) -> torch.Tensor:
        """uint8 [N, K] in 0..15."""
        return unpack_q4_blocks(self.qt.t())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the reference the kernel is tested against."""
        k, g = self.in_features, self.group_size
        d = self.d.float().t().repeat_interleave(g, dim=1)[:, :k]
        q = self.codes().float()
        if self.offset_kind == OFFSET_PLANE:
            assert self.offset is not None
            return q * d + self.offset.float().t().repeat_interleave(g, dim=1)[:, :k]
        z = 8.0 if self.offset is None else self.offset.float().t().repeat_interleave(g, 1)[:, :k]
        return (q - z) * d


def _check(in_features: int, group_size: int, groups: int, name: str) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{name}: group size must be one of {GROUP_SIZES}, got {group_size}")
    if in_features % BLOCK:
        raise ValueError(f"{name}: in_features {in_features} is not a multiple of {BLOCK}")
    if groups != -(-in_features // group_size):
        raise ValueError(f"{name}: {groups} scale groups for in_features {in_features} "
                         f"and group size {group_size}")


def _unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] two codes a byte, low nibble first -> [..., 2n]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _zeros_by_group(zeros: torch.Tensor, out_features: int, groups: int) -> torch.Tensor:
    """Row-major [N, G] zero points packed two a byte -> uint8 [G, N]."""
    z = _unpack_pairs(zeros.flatten())[: out_features * groups]
    return z.view(out_features, groups).t().contiguous()


def repack_int4_rows(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_zero_point: torch.Tensor | None, in_features: int,
                     group_size: int, name: str = "weight") -> Int4Tiles:
    """tessera INT4 rows (`Int4Linear`'s checkpoint tensors: weight_packed uint8 [N, ceil(K/2)],
    weight_scale bf16 [N, G], weight_zero_point uint8 [ceil(N*G/2)] or None) -> Int4Tiles.
    ValueError if K is not a multiple of 32 or the group size is not 32, 64 or 128."""
    n, groups = weight_scale.shape
    _check(in_features, group_size, groups, name)
    codes = _unpack_pairs(weight_packed)[:, :in_features]
    qt = pack_q4_blocks(codes).t().contiguous()
    if weight_zero_point is None:
        return Int4Tiles(qt, weight_scale.t().contiguous(), None, OFFSET_SYMMETRIC, group_size)
    zeros = _zeros_by_group(weight_zero_point, n, groups)
    return Int4Tiles(qt, weight_scale.t().contiguous(), zeros, OFFSET_ZEROS, group_size)


def repack_q4_blocks(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                     group_size: int, zeros: torch.Tensor | None = None,
                     name: str = "weight") -> Int4Tiles:
    """Q4 block planes (`kernels/qgemv.py`: qs uint8 [N, K/2], d and m [N, G]; `zeros` 4-bit
    zero points instead of m, or neither for symmetric codes) -> Int4Tiles (a transpose)."""
    n, groups = d.shape
    _check(qs.shape[1] * 2, group_size, groups, name)
    if m is not None and zeros is not None:
        raise ValueError(f"{name}: an m plane or zero points, not both")
    qt = qs.t().contiguous()
    if m is not None:
        return Int4Tiles(qt, d.t().contiguous(), m.t().contiguous(), OFFSET_PLANE, group_size)
    if zeros is not None:
        return Int4Tiles(qt, d.t().contiguous(), _zeros_by_group(zeros, n, groups),
                         OFFSET_ZEROS, group_size)
    return Int4Tiles(qt, d.t().contiguous(), None, OFFSET_SYMMETRIC, group_size)
