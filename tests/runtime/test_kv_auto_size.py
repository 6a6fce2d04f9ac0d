"""With no KV budget given, the pool is sized from the memory the machine has (a share of what is
available once the weights are loaded, clamped), the planner agrees with what was allocated,
and an idle pool holds little resident memory (its pages are committed when first written)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ops.planner.engine import memory_report
from runtime.config import EngineConfig, ModelConfig
from runtime.engine import LLMEngine
from runtime.kv.budget import (
    KV_AUTO_FRACTION,
    KV_AUTO_MAX_BYTES,
    KV_AUTO_MIN_BYTES,
    auto_kv_cache_bytes,
    available_memory_bytes,
)
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.loader import open_checkpoint
from runtime.loader.checkpoint import Checkpoint
from runtime.memory import measure_memory

GIB = 1 << 30


def test_auto_budget_is_a_share_of_available_memory_within_bounds():
    assert auto_kv_cache_bytes(8 * GIB) == int(8 * GIB * KV_AUTO_FRACTION)
    assert auto_kv_cache_bytes(100 << 20) == KV_AUTO_MIN_BYTES
    assert auto_kv_cache_bytes(1 << 40) == KV_AUTO_MAX_BYTES
    assert 0 < available_memory_bytes()


@dataclass
class _RandomCheckpoint(Checkpoint):
    """A 2-layer random Llama in memory, with the default model's tokenizer."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        g = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return 0.05 * torch.randn(*shape, generator=g)

        yield "model.embed_tokens.weight", rand(c.vocab_size, c.hidden_size)
        yield "model.norm.weight", 1 + rand(c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", 1 + rand(c.hidden_size)
            yield p + "post_attention_layernorm.weight", 1 + rand(c.hidden_size)
            for name, rows, cols in (("q", c.q_size, c.hidden_size),
                                     ("k", c.kv_size, c.hidden_size),
                                     ("v", c.kv_size, c.hidden_size),
                                     ("o", c.hidden_size, c.q_size)):
                yield p + f"self_attn.{name}_proj.weight", rand(rows, cols)
            for name in ("gate", "up"):
                yield p + f"mlp.{name}_proj.weight", rand(c.intermediate_size, c.hidden_size)
            yield p + "mlp.down_proj.weight", rand(c.hidden_size, c.intermediate_size)


@pytest.fixture(scope="module")
def tiny_checkpoint() -> Checkpoint:
    config = ModelConfig("LlamaForCausalLM", 49152, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0, 512,
                         tie_word_embeddings=True, eos_token_ids=(2,))
    tokenizer = open_checkpoint(None).tokenizer  # reads the GGUF's metadata, not its tensors
    return _RandomCheckpoint(config, tokenizer, Path("tiny-random"), "tiny-random")


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
