"""FP8 (e4m3) KV pages on the CPU path: gather whole (head, page) rows and decode their bytes.

Prefill attention uses this (decode attention reads pages in place, `kernels/cpu/paged_decode.cpp`).
The decode is integer bit arithmetic, exact for every finite e4m3 value, in the C++ op
`kernels/cpu/e4m3_gather.cpp` or, without a C++ toolchain, the same arithmetic in torch ops.
(`torch.compile` of the torch version was tried: a fast loop, but ~150 us of guard and dispatch
cost per call, 60 calls a step.) Per-(token, head) scales are applied by the caller.
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import native_ops
from kernels.fp8 import decode_e4m3_bits


def ref_gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """flat: [rows_total, n] uint8 (e4m3 bytes); rows: [R] long -> [R, n] float32 values."""
    return decode_e4m3_bits(flat.index_select(0, rows))


def gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """As `ref_gather_e4m3_rows`, through the `gather_e4m3_rows` op (contiguous pages)."""
    if not flat.is_contiguous():
        return ref_gather_e4m3_rows(flat, rows)
    return native_ops().gather_e4m3_rows(flat, rows.to(torch.int64))
