"""FP8 (e4m3) KV pages on the CPU path: gather whole (head, page) rows and decode their bytes.

The decode is integer bit arithmetic, exact for every finite e4m3 value. It runs in a small C++
op (`kernels/cpu/e4m3_gather.cpp`, built once per machine with torch's cpp_extension): ~12 us
per call at small sizes and ~0.8 ns per element, 2-4x the torch ops on small batches but still
~3.5x a bf16 gather-and-cast (`python3 -m ops.bench.bench_kv_gather`; its loop is not
vectorized yet). Without a C++ toolchain it falls back to the same arithmetic in torch ops.
(`torch.compile` of the torch version was tried: a 0.4 ns loop, but ~150 us of guard and
dispatch cost per call, 60 calls a step, made fp8 decode 15-25% slower than bf16; and it needs
the same C++ compiler.) Per-(token, head) scales are not applied here: decode attention folds
them into scores and probabilities ([.., L] multiplies instead of [.., L, dim]).
`TESSERA_NATIVE=0` skips the C++ op.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tessera.kernels")

_E4M3_TO_F32 = 2.0**120  # e4m3 bits shifted into an fp32 pattern are the value times 2**-120


def ref_gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """flat: [rows_total, n] uint8 (e4m3 bytes); rows: [R] long -> [R, n] float32 values."""
    b = flat.index_select(0, rows).to(torch.int32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return bits.view(torch.float32) * _E4M3_TO_F32


@functools.cache
def _native() -> Any | None:
    if os.environ.get("TESSERA_NATIVE") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).parent / "cpu" / "e4m3_gather.cpp"
        return load("tessera_e4m3_gather", [str(source)], extra_cflags=["-O3"], verbose=False)
    except Exception as e:  # no C++ toolchain here: stay correct on the slower path
        log.warning("C++ e4m3 gather unavailable (%s); using torch ops", e)
        return None


def gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    native = _native() if flat.device.type == "cpu" and flat.is_contiguous() else None
    if native is None:
        return ref_gather_e4m3_rows(flat, rows)
    return native.gather_e4m3_rows(flat, rows.to(torch.int64))
