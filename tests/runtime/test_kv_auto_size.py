"""With no KV budget given, the pool is sized from the memory the machine has (a share of what is
available once the weights are loaded, clamped), the planner agrees with what was allocated,
and an idle pool holds little resident memory (its pages are committed when first written)."""

from __future__ import annotations

import pytest

from ops.planner.engine import memory_report
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.kv.budget import (
    KV_AUTO_FRACTION,
    KV_AUTO_MAX_BYTES,
    KV_AUTO_MIN_BYTES,
    auto_kv_cache_bytes,
    available_memory_bytes,
)
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.loader.checkpoint import Checkpoint
from runtime.memory import measure_memory
from tests.helpers import tiny_random_checkpoint

GIB = 1 << 30


def test_auto_budget_is_a_share_of_available_memory_within_bounds():
    assert auto_kv_cache_bytes(8 * GIB) == int(8 * GIB * KV_AUTO_FRACTION)
    assert auto_kv_cache_bytes(100 << 20) == KV_AUTO_MIN_BYTES
    assert auto_kv_cache_bytes(1 << 40) == KV_AUTO_MAX_BYTES
    assert 0 < available_memory_bytes()


@pytest.fixture(scope="module")
def tiny_checkpoint() -> Checkpoint:
    return tiny_random_checkpoint()


def test_engine_without_a_budget_sizes_its_pool_from_free_memory(tiny_checkpoint):
    before = auto_kv_cache_bytes()
    engine = LLMEngine(tiny_checkpoint, EngineConfig(kv_cache_bytes=None, max_num_seqs=4))
    after = auto_kv_cache_bytes()
    budget = engine.kv_cache_budget_bytes
    # Free memory moves a little between reads on a shared machine; never by a quarter.
    assert min(before, after) * 0.75 <= budget <= max(before, after) * 1.25
    assert engine.kv_cache.num_bytes <= budget
    assert engine.kv_cache.num_bytes > budget - engine.kv_cache.spec.bytes_per_page
    report = memory_report(measure_memory(engine))
    assert report.planned_kv_capacity_tokens == engine.kv_capacity_tokens
    assert report.planned_kv_bytes_per_token == engine.kv_cache.spec.bytes_per_token


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_an_unwritten_cpu_pool_is_not_resident(tiny_checkpoint):
    spec = KVCacheSpec.for_model(tiny_checkpoint.config, 16, "fp32")
    start = _rss_bytes()
    cache = KVCache.within(spec, 512 << 20, "cpu")
    assert cache.num_bytes > 500 << 20
    assert _rss_bytes() - start < 16 << 20
    layer = cache.layer(1)
    assert not layer.k.any() and not layer.v.any()  # reads as zeros all the same
    layer.k[:, 3].fill_(1.0)
    assert int(cache.k[1, :, 3].sum()) == layer.k[:, 3].numel()
