"""`python -m kernels`: build (or load from the cache) the C++ CPU ops now, not on a request's
path; prints whether they are usable."""

from __future__ import annotations

import logging

from kernels.cpu_ops import build_tag, native_status

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(f"tessera C++ CPU ops: {native_status()} (build {build_tag()})")
