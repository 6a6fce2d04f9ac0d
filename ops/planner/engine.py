"""The running engine's memory: what it holds, next to what the planner predicts for it.

`memory_report(llm.memory_footprint())` (and, later, the worker status) describes an engine
with the same code as `tessera plan`. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ops.planner.architectures import parse_config
from ops.planner.plan import Plan, PlanConfig, make_plan
from runtime.config import ModelConfig
from runtime.formats import WeightFormat, canonical_name
from runtime.memory import MemoryFootprint


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


LINEAR_CATEGORIES = ("attention", "dense_mlp", "shared_experts", "routed_experts")


def plan_for_engine(model_config: ModelConfig, dtype: str, kv_cache_dtype: str,
                    kv_cache_bytes: int, page_size: int,
                    weights: WeightFormat | None = None) -> Plan:
    """The plan of a single-device engine: linear layers in `weights` (None = `dtype`),
    everything else in `dtype`."""
    dtype = canonical_name(dtype)
    extra: dict[str, Any] = {}
    if weights is not None and weights.name == "int4":
        extra = {"int4_targets": LINEAR_CATEGORIES, "int4_group_size": weights.group_size,
                 "int4_symmetric": weights.symmetric}
    config = PlanConfig(weights=dtype if weights is None else weights.name, dtype=dtype,
                        kv_cache_dtype=canonical_name(kv_cache_dtype),
                        kv_cache_bytes=kv_cache_bytes, page_size=page_size, **extra)
    # NOTE: the engine serves no multi-token-prediction layers, so the plan counts none.
    return make_plan(parse_config(model_config.to_hf_config(), mtp_layers=0), config)


def linear_bytes(plan: Plan) -> int:
    return sum(c.total_bytes for c in plan.breakdown if c.category in LINEAR_CATEGORIES)


def memory_report(footprint: MemoryFootprint) -> MemoryReport:
    """A running engine's footprint (`LLM.memory_footprint()`) beside the plan for the same
    model, formats and pool. Both phases' models are resident; they share everything but the
    linear layers."""
    f = footprint
    args = (f.model, f.dtype, f.formats.kv.name, f.kv_cache_budget_bytes, f.page_size)
    plan = plan_for_engine(*args, weights=f.formats.prefill.weights)
    planned_weights = plan.weight_bytes_per_device
    if f.separate_decode_weights:
        planned_weights += linear_bytes(plan_for_engine(*args, weights=f.formats.decode.weights))
    assert plan.kv_capacity_tokens is not None  # a fixed pool always yields a capacity
    return MemoryReport(f.weight_bytes, f.kv_bytes_per_token, f.kv_capacity_tokens,
                        f.kv_cache_bytes, planned_weights, plan.kv_bytes_per_token,
                        plan.kv_capacity_tokens, plan)
