"""What a running engine holds in memory, measured from its tensors, with the settings that sized
it: the facts `ops.planner.engine.memory_report` sets beside the planner's prediction.

Reads only the engine's public attributes; imports no torch itself.
"""

from __future__ import annotations

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


def resident_bytes(*modules: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer storage across these modules."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if not t.is_meta:
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
