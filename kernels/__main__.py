"""`python -m kernels`: build (or load from the cache) the C++ CPU ops now, not on a request's
path; prints whether they are usable."""

from __future__ import annotations

import logging
import time

from kernels.cpu_ops import build_pending, build_tag, native_status

logging.basicConfig(level=logging.INFO, format="%(message)s")
started = time.monotonic()
if build_pending():
    print(f"tessera C++ CPU ops: compiling build {build_tag()} for this CPU "
          "(one to a few minutes on 2 cores; once per machine)...", flush=True)
status = native_status()
print(f"tessera C++ CPU ops: {status} (build {build_tag()}, {time.monotonic() - started:.0f} s)")
