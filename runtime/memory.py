"""What a running engine holds in memory, measured from its tensors, with the settings that sized
it: the facts `ops.planner.engine.memory_report` sets beside the planner's prediction; and the
KV budget an engine takes from what the machine has when none is given.

Reads only the engine's public attributes; imports no torch itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config import ModelConfig
from runtime.formats import canonical_name
from runtime.serving_formats import ServingFormats

if TYPE_CHECKING:
    from torch import nn

    from runtime.engine import LLMEngine


@dataclass(frozen=True)
class MemoryFootprint:
    model: ModelConfig
    dtype: str  # the compute dtype: "fp32", "bf16" or "fp16"
    formats: ServingFormats
    page_size: int
    kv_cache_budget_bytes: int  # what the config allows the pool
    weight_bytes: int  # every distinct parameter and buffer storage of both phases' models
    separate_decode_weights: bool  # the decode phase runs its own linear layers
    kv_bytes_per_token: int  # K and V of one token in every layer, scales included
    kv_capacity_tokens: int
    kv_cache_bytes: int  # the pool as allocated (K, V and scales, all layers)


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


def resident_bytes(*modules: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer storage across these modules."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure_memory(engine: LLMEngine) -> MemoryFootprint:
    cache = engine.kv_cache
    return MemoryFootprint(
        model=engine.model_config, dtype=canonical_name(str(engine.dtype)),
        formats=engine.formats, page_size=engine.config.page_size,
        kv_cache_budget_bytes=engine.kv_cache_budget_bytes,
        weight_bytes=resident_bytes(engine.prefill_model, engine.decode_model),
        separate_decode_weights=engine.decode_model is not engine.prefill_model,
        kv_bytes_per_token=cache.spec.bytes_per_token,
        kv_capacity_tokens=engine.kv_capacity_tokens, kv_cache_bytes=cache.num_bytes)
