"""The running engine's memory: what it holds, next to what the planner predicts for it.

Used by `LLM.memory_report()` (and, later, the worker status), so the engine describes itself
with the same code as `tessera plan`. Reads tensors it is handed; imports no torch itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ops.planner.architectures import parse_config
from ops.planner.plan import Plan, PlanConfig, make_plan
from runtime.formats import canonical_name


@dataclass(frozen=True)
class MemoryReport:
    weight_bytes: int  # sum over the model's parameters as allocated
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    kv_cache_bytes: int  # the pool as allocated (K and V, all layers)
    planned_weight_bytes: int
    planned_kv_bytes_per_token: int
    planned_kv_capacity_tokens: int
    plan: Plan

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "plan"}
        out["plan"] = self.plan.to_json()
        return out


def hf_config(model_config: Any) -> dict[str, Any]:
    """The engine's ModelConfig as the config.json fields the planner reads."""
    c = model_config
    return {"architectures": [c.architecture], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias}


def plan_for_engine(model_config: Any, dtype: str, kv_cache_dtype: str, kv_cache_bytes: int,
                    page_size: int) -> Plan:
    """The plan of a single-device engine that stores every tensor in `dtype`."""
    dtype = canonical_name(dtype)
    config = PlanConfig(weights=dtype, dtype=dtype, kv_cache_dtype=canonical_name(kv_cache_dtype),
                        kv_cache_bytes=kv_cache_bytes, page_size=page_size)
    return make_plan(parse_config(hf_config(model_config)), config)


def memory_report(engine: Any) -> MemoryReport:
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    cache = engine.kv_cache
    plan = plan_for_engine(engine.model_config, str(engine.dtype), str(cache.spec.dtype),
                           engine.config.kv_cache_bytes, engine.config.page_size)
    assert plan.kv_capacity_tokens is not None  # a fixed pool always yields a capacity
    return MemoryReport(weight_bytes, cache.spec.bytes_per_token, engine.kv_capacity_tokens,
                        cache.num_bytes, plan.weight_bytes_per_device, plan.kv_bytes_per_token,
                        plan.kv_capacity_tokens, plan)
