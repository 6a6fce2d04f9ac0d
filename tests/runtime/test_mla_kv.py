"""DeepSeek-V3's KV pages hold the MLA latent (kv_lora_rank + qk_rope_head_dim per token and
layer, no per-head K and V); with FP8 KV the latent pages are what is quantized, and the engine's
capacity ratio FP8/BF16 in equal bytes is the planner's."""

from __future__ import annotations

import pytest
import torch

from kernels import dequantize_fp8_kv
from ops.planner.engine import memory_report
from runtime import LLM, SamplingParams
from tests.runtime.moe_models import CONFIGS, build_tiny_moe

pytestmark = pytest.mark.slow

ARCH = "DeepseekV3ForCausalLM"
KV_BYTES = 4 << 20
LATENT_DIM = CONFIGS[ARCH][1]["kv_lora_rank"] + CONFIGS[ARCH][1]["qk_rope_head_dim"]
PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """One thread, as the other model-comparison modules run."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_tokenizer):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    build_tiny_moe(ARCH, path, hf_tokenizer)
    return path


@pytest.fixture(scope="module")
def engines(checkpoint):
    return {kv: LLM(model=str(checkpoint), kv_cache_bytes=KV_BYTES, kv_cache_dtype=kv)
            for kv in ("auto", "bf16", "fp8")}


def prefilled_latents(llm: LLM) -> torch.Tensor:
    """The prompt's latent pages in every layer after its prefill, as float32:
    [layers, tokens, latent_dim]. The request is aborted afterwards."""
    engine = llm.engine
    seq = engine.add_request("latent", PROMPT, SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    assert seq.num_computed_tokens == len(seq.prompt_token_ids)
    cache = engine.kv_cache
    pages = torch.tensor([ref.page_id for ref in seq.page_table])
    data = cache.k[:, 0].index_select(1, pages)  # [layers, pages, page_size, dim]
    if cache.k_scale is not None:
        data = dequantize_fp8_kv(data, cache.k_scale[:, 0].index_select(1, pages))
    engine.abort_request("latent")
    engine.check_quiescent()
    return data.float().flatten(1, 2)[:, : len(seq.prompt_token_ids)]


def test_pages_hold_one_latent_vector_per_token_and_no_values(engines):
    for kv, llm in engines.items():
        cache = llm.engine.kv_cache
        assert cache.v is None and cache.v_scale is None, kv
        assert cache.k.shape[1] == 1 and cache.k.shape[-1] == LATENT_DIM, kv
        assert llm.engine.stats().kv_bytes_per_token == 3 * LATENT_DIM * cache.k.element_size() \
            + (3 * 2 if kv == "fp8" else 0)  # 3 layers; fp8 adds one bf16 scale per token
    fp8 = engines["fp8"].engine.kv_cache
    assert fp8.k.dtype == torch.uint8 and fp8.k_scale.shape == fp8.k.shape[:-1]


def test_fp8_pages_are_the_quantized_latent(engines):
    exact = prefilled_latents(engines["auto"])
    quantized = prefilled_latents(engines["fp8"])
    assert exact.abs().max() > 0.5
    # Layer 0's latents come from the same inputs in both engines (later layers' inputs went
    # through FP8 attention). e4m3 keeps 3 mantissa bits: each element is within 1/16 of its
    # token's largest magnitude.
    bound = exact[0].abs().amax(dim=-1, keepdim=True) / 16
    assert ((quantized[0] - exact[0]).abs() <= bound).all()
    assert not torch.equal(quantized[0], exact[0])  # quantized, not a float copy
    assert (quantized - exact).abs().max() < 0.25 * exact.abs().max()


def test_fp8_to_bf16_capacity_ratio_matches_the_planner(engines):
    reports = {kv: memory_report(engines[kv].memory_footprint()) for kv in ("bf16", "fp8")}
    for kv, report in reports.items():
        assert report.kv_bytes_per_token == report.planned_kv_bytes_per_token, kv
        assert report.kv_capacity_tokens == report.planned_kv_capacity_tokens, kv
        assert report.weight_bytes == report.planned_weight_bytes, kv
    ratio = engines["fp8"].kv_capacity_tokens / engines["bf16"].kv_capacity_tokens
    planned = (reports["fp8"].planned_kv_capacity_tokens
               / reports["bf16"].planned_kv_capacity_tokens)
    assert ratio == planned
    # (576 + 2) / 576 per token for DeepSeek-V3: ~1.99x; (48 + 2) / 96 here: ~1.92x
    assert 1.9 < ratio < 2.0

