"""The KV pool budget an engine takes from what the machine has, when none is given."""

from __future__ import annotations

import os

# With no --kv-cache-bytes: this share of the memory available once the weights are loaded,
# within these bounds. Pages are committed by the OS only when first written (see
# runtime.kv.cache), so an idle engine holds little of its pool.
KV_AUTO_FRACTION = 0.25
KV_AUTO_MIN_BYTES = 64 << 20
KV_AUTO_MAX_BYTES = 8 << 30


def available_memory_bytes() -> int:
    """Memory the OS could give this process now without swapping (Linux MemAvailable;
    elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_kv_cache_bytes(available_bytes: int | None = None,
                        fraction: float = KV_AUTO_FRACTION) -> int:
    """The KV pool budget from `available_bytes` (None: measured now, after the weights are
    resident, so they are already taken out): `fraction` of it, clamped to
    [KV_AUTO_MIN_BYTES, KV_AUTO_MAX_BYTES]."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    return int(min(KV_AUTO_MAX_BYTES, max(KV_AUTO_MIN_BYTES, available * fraction)))
