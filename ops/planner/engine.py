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


LINEAR_CATEGORIES = ("attention", "dense_mlp", "shared_experts", "routed_experts")


def plan_for_engine(model_config: Any, dtype: str, kv_cache_dtype: str, kv_cache_bytes: int,
                    page_size: int, weights: Any = None) -> Plan:
    """The plan of a single-device engine: linear layers in `weights` (a WeightFormat; None =
    `dtype`), everything else in `dtype`."""
    dtype = canonical_name(dtype)
    extra: dict[str, Any] = {}
    if weights is not None and weights.name == "int4":
        extra = {"int4_targets": LINEAR_CATEGORIES, "int4_group_size": weights.group_size,
                 "int4_symmetric": weights.symmetric}
    config = PlanConfig(weights=dtype if weights is None else weights.name, dtype=dtype,
                        kv_cache_dtype=canonical_name(kv_cache_dtype),
                        kv_cache_bytes=kv_cache_bytes, page_size=page_size, **extra)
    return make_plan(parse_config(hf_config(model_config)), config)


def linear_bytes(plan: Plan) -> int:
    return sum(c.total_bytes for c in plan.breakdown if c.category in LINEAR_CATEGORIES)


def resident_bytes(*modules: Any) -> int:
    """Bytes of every distinct parameter and buffer storage across these modules."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def memory_report(engine: Any) -> MemoryReport:
    """Both phases' models are resident; they share everything but the linear layers."""
    weight_bytes = resident_bytes(engine.prefill_model, engine.decode_model)
    cache = engine.kv_cache
    formats = engine.formats
    args = (engine.model_config, str(engine.dtype), str(cache.spec.dtype),
            engine.config.kv_cache_bytes, engine.config.page_size)
    plan = plan_for_engine(*args, weights=formats.prefill.weights)
    planned_weights = plan.weight_bytes_per_device
    if engine.decode_model is not engine.prefill_model:
        planned_weights += linear_bytes(plan_for_engine(*args, weights=formats.decode.weights))
    assert plan.kv_capacity_tokens is not None  # a fixed pool always yields a capacity
    return MemoryReport(weight_bytes, cache.spec.bytes_per_token, engine.kv_capacity_tokens,
                        cache.num_bytes, planned_weights, plan.kv_bytes_per_token,
                        plan.kv_capacity_tokens, plan)
