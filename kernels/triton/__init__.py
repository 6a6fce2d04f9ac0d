"""Triton kernels for tessera's paged KV: attention, store-with-quantization and the tag check.

`paged_attention.py`, `store_kv.py` and `verify_pages.py` hold only `@triton.jit` code;
`launch.py` holds their launchers (shape, dtype and stride asserts, grids) with the signatures
the `tessera` ops' CUDA implementations call. Nothing here is imported by `kernels`: importing
`kernels` never needs triton or a GPU. On CPU the kernels run in Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is first imported), which is how the test suite runs them.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether the triton package is installed (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None
