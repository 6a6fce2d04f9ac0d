"""`LLMEngine`: the build, admission, step and driver halves (this package's modules) put
together, with what an operator reads of it (stats, quiescence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import EngineConfig
from runtime.engine.admission import Admission
from runtime.engine.build import EngineBuild
from runtime.engine.drivers import Drivers
from runtime.engine.step import EngineStep
from runtime.loader import Checkpoint, open_checkpoint
from runtime.sequence import Sequence
from runtime.step_times import EngineTimes


@dataclass(frozen=True)
class EngineStats:
    num_pages: int
    num_free_pages: int
    page_size: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_enabled: bool = False
    num_cached_pages: int = 0  # pages the prefix cache holds
    num_evictable_pages: int = 0  # of those, held by the cache alone


class LLMEngine(EngineBuild, Admission, EngineStep, Drivers):
    """One engine over one checkpoint: `add_request`, then `step` until done. Not thread-safe:
    runtime.async_engine runs every call on one thread."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self._build(checkpoint, config)
        self.requests: dict[str, Sequence] = {}
        self.shared_prefixes: dict[str, tuple[list[int], frozenset[str]]] = {}
        self._accumulators = {}
        self.times = EngineTimes()

    @classmethod
    def from_path(cls, model: str | None, config: EngineConfig) -> LLMEngine:
        return cls(open_checkpoint(model), config)

    @property
    def model(self) -> torch.nn.Module:
        """The prefill model (the decode model shares all but its linear layers with it)."""
        return self.prefill_model

    def release_idle_memory(self) -> None:
        """Drops what a busy engine caches in its modules (the bf16 weight copies of
        `--gguf-activations bf16`); they are rebuilt by the next step that needs them. For an
        idle engine only: a step must not be running."""
        for model in {id(m): m for m in (self.prefill_model, self.decode_model)}.values():
            for module in model.modules():
                release = getattr(module, "release_cache", None)
                if callable(release):
                    release()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_pages * self.pool.page_size

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        return EngineStats(self.pool.num_pages, self.pool.num_free_pages, self.pool.page_size,
                           self.kv_capacity_tokens, self.kv_cache.spec.bytes_per_token,
                           len(self.scheduler.running), len(self.scheduler.waiting),
                           self.scheduler.num_preemptions, cache is not None,
                           0 if cache is None else len(cache),
                           0 if cache is None else cache.num_evictable)

    def check_quiescent(self) -> None:
        """Raise unless every page is free or held once by the prefix cache alone."""
        if self.requests:
            raise AssertionError(f"{len(self.requests)} requests still in flight")
        if self.prefix_cache is None:
            self.pool.check_quiescent()
        else:
            self.prefix_cache.check_quiescent()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
