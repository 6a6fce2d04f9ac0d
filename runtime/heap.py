"""Give the heap memory freed after model load back to the operating system.

Loading dequantizes and fuses tensors through short-lived buffers; glibc keeps what they freed
in its arenas, so a worker's resident memory at idle stayed hundreds of MB above what it holds.
`malloc_trim(0)` returns those pages (Linux with glibc; a no-op elsewhere).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_heap() -> bool:
    """Return freed heap pages to the OS; whether the C library could be asked to."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
