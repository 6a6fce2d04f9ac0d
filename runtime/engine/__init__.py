"""The engine: admits requests, runs scheduler -> model runner -> sampler steps, emits outputs.

`build` (from config to models, KV pool, scheduler and runner), `admission` (add_request and
its checks), `step` (one step, how requests end), `drivers` (scoring and warm-up loops);
`llm_engine` puts them together as `LLMEngine`.
"""

from __future__ import annotations

from runtime.engine.build import resolve_dtype
from runtime.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine", "resolve_dtype"]
