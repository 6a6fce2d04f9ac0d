"""Linear layers over 4-bit and 8-bit weight blocks, read as stored (no fp32 weight copy).

The block layout, one for every reader (the C++ CPU kernel `kernels/cpu/qgemv.cpp`, these
torch twins, and a GPU kernel: struct-of-arrays, every row's blocks contiguous and 16-byte
aligned when K is a multiple of 32, scales in their own plane for coalesced loads):

- **Q4** (GGUF Q4_0 / Q4_1, tessera INT4): `qs` uint8 [N, K/2]. Row n holds K/32 blocks of
  16 bytes; in block b, byte j holds the 4-bit code q (0..15) of weight 32b+j in its low nibble
  and of weight 32b+j+16 in its high nibble (GGUF's order: one mask gives weights 0..15, one
  shift 16..31). `d`, `m` [N, ceil(K/g)], one per group of g weights (g a multiple of 32; the
  last group may be shorter), float16, bfloat16 or float32 (both the same):
  w = d * q + m. (Q4_0: m = -8d; Q4_1: d and m as stored.) Instead of an `m` plane the kernel
  takes 4-bit zero points (m = -zero * d, tessera's asymmetric INT4) or nothing (m = -8d,
  tessera's symmetric INT4), so INT4 layers keep no extra plane.
- **Q8** (GGUF Q8_0): `qs` int8 [N, K], `d` float16 [N, K/32]: w = d * q.

Activations stay float32 and the weights are formed exactly as `ref_q4_dequantize` forms them,
so the kernel's output differs from `x @ W^T` over the dequantized W only in summation order.
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import native_ops

BLOCK = 32  # weights per block; every group is a whole number of blocks


def pack_q4_blocks(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15 (K a multiple of 32) -> qs uint8 [N, K/2] in block order."""
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    c = codes.reshape(n, k // BLOCK, 2, 16).to(torch.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_q4_blocks(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [N, K/2] in block order -> codes uint8 [N, K]."""
    n, half = qs.shape
    b = qs.reshape(n, half // 16, 16)
    return torch.stack((b & 0x0F, b >> 4), dim=2).reshape(n, half * 2)


def q4_offsets(d: torch.Tensor, m: torch.Tensor | None, zeros: torch.Tensor | None
               ) -> torch.Tensor:
    """float32 [N, G] offsets: `m` itself, else -zero * d from 4-bit zero points (packed two a
    byte over the row-major [N, G], low nibble first), else -8 d (symmetric codes)."""
    if m is not None:
        return m.float()
    if zeros is None:
        return -8.0 * d.float()
    z = torch.stack((zeros & 0x0F, zeros >> 4), dim=-1).flatten()[: d.numel()]
    return -z.view(d.shape).float() * d.float()


def ref_q4_dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                      group_size: int, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of the C++ dequantize: float32 [N, K], w = d * q + m per group."""
    codes = unpack_q4_blocks(qs).float()
    k = codes.shape[1]
    scale = d.float().repeat_interleave(group_size, dim=1)[:, :k]
    offset = q4_offsets(d, m, zeros).repeat_interleave(group_size, dim=1)[:, :k]
    return codes * scale + offset


def ref_q8_dequantize(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Twin of the C++ dequantize: float32 [N, K], w = d * q per block of 32."""
    return qs.float() * d.float().repeat_interleave(BLOCK, dim=1)


def ref_q4_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                  group_size: int, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N]: x @ ref_q4_dequantize(...)^T."""
    return x @ ref_q4_dequantize(qs, d, m, group_size, zeros).t()


def ref_q8_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 -> [..., N]: x @ ref_q8_dequantize(...)^T."""
    return x @ ref_q8_dequantize(qs, d).t()


def q4_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
              group_size: int, zeros: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] over Q4 blocks (layout above; offsets from `m`, `zeros`
    or neither, as `q4_offsets` says), through the `q4_linear_out` op. `out`
    (float32 [rows, N], contiguous) is written in full when given. Raises RuntimeError on
    shapes or dtypes the layout forbids."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = x2.new_empty(x2.shape[0], qs.shape[0]) if out is None else out
    native_ops().q4_linear_out(x2, qs, d, m, zeros, group_size, y)
    return y.view(*x.shape[:-1], qs.shape[0])


def q8_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] over Q8 blocks (layout above), the `q8_linear_out` op;
    `out` as for `q4_linear`."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = x2.new_empty(x2.shape[0], qs.shape[0]) if out is None else out
    native_ops().q8_linear_out(x2, qs, d, y)
    return y.view(*x.shape[:-1], qs.shape[0])


def q4_dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int,
                  zeros: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K] (for many-row matmuls, where a dense fp32 matmul wins)."""
    return native_ops().q4_dequantize(qs, d, m, zeros, group_size)


def q8_dequantize(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]."""
    return native_ops().q8_dequantize(qs, d)
