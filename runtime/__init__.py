"""tessera runtime: the engine and its offline API (the worker process is `gateway/worker.py`).

`from runtime import LLM, SamplingParams` works as in vLLM. Heavy imports are lazy so that the
torch-free bookkeeping modules (scheduler, page pool) import in microseconds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]

_EXPORTS = {
    "LLM": "runtime.llm",
    "LLMEngine": "runtime.engine",
    "SamplingParams": "runtime.sampling_params",
    "RequestOutput": "runtime.outputs",
    "CompletionOutput": "runtime.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
