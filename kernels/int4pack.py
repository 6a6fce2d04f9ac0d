"""torch's CPU int4pack layout and matmul (`aten._weight_int4pack_mm_for_cpu`) as the tessera op
`int4pack_mm`: the CPU kernel is torch's own, `ref_int4pack_mm` its twin (the layout decoded,
`(q - 8) * scale + zero` per group, one bf16 rounding of x and of y).

The layout is an implementation detail of torch's CPU build: [N, K/2] bytes, rows interleaved
in blocks of 64 (byte j of (block, column) = row j | row 32+j << 4). It is used only where this
build packs that way (`int4pack_layout_is_known`), so weights can always be read back exactly.
"""

from __future__ import annotations

import functools

import torch

KERNEL_BLOCK_N = 64  # rows interleaved per block in torch's CPU int4pack layout (AVX512 build)


def pack_int4pack(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 (N % 64 == 0, K % 32 == 0) -> torch's packed bytes."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def unpack_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """torch's packed bytes [N, K/2] -> codes uint8 [N, K]."""
    # packed: [n/64 blocks, k, 32] bytes; byte j of (block, col) = row j | row 32+j << 4
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // KERNEL_BLOCK_N, k, KERNEL_BLOCK_N // 2)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=1)  # [n/64, 2, k, 32]
    return codes.transpose(2, 3).reshape(n, k)


@functools.cache
def int4pack_layout_is_known() -> bool:
    """Whether this torch packs the way `unpack_int4pack` decodes."""
    try:
        codes = torch.randint(0, 16, (2 * KERNEL_BLOCK_N, 64), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(0))
        return torch.equal(unpack_int4pack(pack_int4pack(codes)), codes)
    except (RuntimeError, AttributeError):
        return False


def ref_int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                    scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """Twin: x bf16 [M, K], packed [N, K/2], scales_and_zeros bf16 [K/g, N, 2] (scale, zero)
    -> bf16 [M, N] = x @ ((q - 8) * scale + zero)^T, sums in float32."""
    codes = unpack_int4pack(packed).float()
    k = codes.shape[1]
    sz = scales_and_zeros.float()
    scale = sz[..., 0].t().repeat_interleave(group_size, dim=1)[:, :k]
    zero = sz[..., 1].t().repeat_interleave(group_size, dim=1)[:, :k]
    return (x.float() @ ((codes - 8.0) * scale + zero).t()).to(torch.bfloat16)


def cpu_int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                    scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The CPU kernel: torch's."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
