"""FP8 (e4m3) KV pages on the CPU path: gather whole (head, page) rows and decode their bytes.

The decode is integer bit arithmetic (exact for every finite e4m3 value), run under
`torch.compile` so gather and decode are one vectorized loop: ~0.4-0.5 ns per element on the
development CPU, against ~2.6-3.7 ns for `fp8.to(float32)` or a lookup table (DESIGN.md).
Per-(token, head) scales are not applied here: decode attention folds them into the scores and
probabilities ([.., L] instead of [.., L, dim] multiplies). `TESSERA_COMPILE=0` runs it eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger("tessera.kernels")

_E4M3_TO_F32 = 2.0**120  # e4m3 bits shifted into an fp32 pattern are the value times 2**-120


def ref_gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """flat: [rows_total, n] uint8 (e4m3 bytes); rows: [R] long -> [R, n] float32 values."""
    b = flat.index_select(0, rows).to(torch.int32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return bits.view(torch.float32) * _E4M3_TO_F32


_compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
_compile_failed = False
# Below this many elements the compiled call's fixed cost (guards, ~60 us) outweighs its
# faster loop: measured crossover ~20k elements on the development CPU, one thread.
EAGER_MAX_ELEMENTS = 24_576


def gather_e4m3_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    global _compiled, _compile_failed
    if (flat.device.type != "cpu" or _compile_failed or os.environ.get("TESSERA_COMPILE") == "0"
            or rows.numel() * flat.shape[1] <= EAGER_MAX_ELEMENTS):
        return ref_gather_e4m3_rows(flat, rows)
    if _compiled is None:
        _compiled = torch.compile(ref_gather_e4m3_rows, dynamic=True)
    try:
        return _compiled(flat, rows)
    except Exception as e:  # no C++ toolchain, or an inductor bug: stay correct, run eagerly
        log.warning("compiled e4m3 gather unavailable (%s); using the eager path", e)
        _compile_failed = True
        return ref_gather_e4m3_rows(flat, rows)
