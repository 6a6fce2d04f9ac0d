"""FP8 (e4m3) KV pages on the CPU path: gather whole (head, page) rows and decode their bytes.

The decode is integer bit arithmetic, exact for every finite e4m3 value. Three ways to run it,
fastest available first: a small C++ op (`kernels/cpu/e4m3_gather.cpp`, built once per machine
with torch's cpp_extension; ~10 us per call at decode sizes and ~0.8 ns per element, about the
cost of reading bf16 pages), the same Python function under `torch.compile` (a ~0.4 ns loop
but ~150 us of guard and dispatch cost per call, which at 60 calls a step made fp8 decode 15-25%
slower than bf16), and eager torch ops (~2.6 ns per element). Per-(token, head) scales are not
applied here: decode attention folds them into scores and probabilities ([.., L] multiplies
instead of [.., L, dim]). `TESSERA_NATIVE=0` skips the C++ op, `TESSERA_COMPILE=0` the compile.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tessera.kernels")

_E4M3_TO_F32 = 2.0**120  # e4m3 bits shifted into an fp32 pattern are the value times 2**-120
# The compiled path's fixed cost outweighs its faster loop below ~20k elements.
EAGER_MAX_ELEMENTS = 24_576


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
    except Exception as e:  # no C++ toolchain here: stay correct on the slower paths
        log.warning("C++ e4m3 gather unavailable (%s); using torch ops", e)
        return None


@functools.cache
def _compiled() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    if os.environ.get("TESSERA_COMPILE") == "0":
        return None
    return torch.compile(ref_gather_e4m3_rows, dynamic=True)


def gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if flat.device.type != "cpu":
        return ref_gather_e4m3_rows(flat, rows)
    native = _native()
    if native is not None and flat.is_contiguous():
        return native.gather_e4m3_rows(flat, rows.to(torch.int64))
    compiled = _compiled()
    if compiled is None or rows.numel() * flat.shape[1] <= EAGER_MAX_ELEMENTS:
        return ref_gather_e4m3_rows(flat, rows)
    try:
        return compiled(flat, rows)
    except Exception as e:  # an inductor failure: stay correct, run eagerly from now on
        log.warning("compiled e4m3 gather failed (%s); using the eager path", e)
        os.environ["TESSERA_COMPILE"] = "0"
        _compiled.cache_clear()
        return ref_gather_e4m3_rows(flat, rows)
