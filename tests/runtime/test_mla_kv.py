"""DeepSeek-V3's KV pages hold the MLA latent (kv_lora_rank + qk_rope_head_dim per token and
layer, no per-head K and V); with FP8 or INT8 KV the latent pages are what is quantized (never
rotated), and the engine's capacity ratio FP8/BF16 in equal bytes is the planner's."""

from __future__ import annotations

import pytest
import torch

from kernels import dequantize_latent_rows
from ops.planner.engine import memory_report
from runtime import LLM, SamplingParams
from tests.runtime.moe_models import CONFIGS, build_tiny_moe

pytestmark = pytest.mark.slow

ARCH = "DeepseekV3ForCausalLM"
KV_BYTES = 4 << 20
LORA, ROPE = CONFIGS[ARCH][1]["kv_lora_rank"], CONFIGS[ARCH][1]["qk_rope_head_dim"]
LATENT_DIM = LORA + ROPE
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
            for kv in ("auto", "bf16", "fp8", "int8")}


def prefilled_latents(llm: LLM) -> torch.Tensor:
    """The prompt's latent pages in every layer after its prefill, as float32:
    [layers, tokens, latent_dim]. The request is aborted afterwards."""
    engine = llm.engine
    seq = engine.add_request("latent", PROMPT, SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    assert seq.num_computed_tokens == len(seq.prompt_token_ids)
    cache = engine.kv_cache
    pages = torch.tensor([ref.page_id for ref in seq.page_table])
    data = cache.k[:, 0].index_select(1, pages)  # [layers, pages, page_size, row_width]
    if cache.k_scale is not None:
        data = dequantize_latent_rows(data, cache.k_scale[:, 0].index_select(1, pages),
                                      LATENT_DIM)
    engine.abort_request("latent")
    engine.check_quiescent()
    return data.float().flatten(1, 2)[:, : len(seq.prompt_token_ids)]


def test_pages_hold_one_latent_vector_per_token_and_no_values(engines):
    for kv in ("auto", "bf16"):
        cache = engines[kv].engine.kv_cache
        assert cache.v is None and cache.v_scale is None and cache.k_scale is None, kv
        assert cache.k.shape[1] == 1 and cache.k.shape[-1] == LATENT_DIM, kv
        assert engines[kv].engine.stats().kv_bytes_per_token == \
            3 * LATENT_DIM * cache.k.element_size(), kv  # 3 layers
    for kv, dtype in (("fp8", torch.uint8), ("int8", torch.int8)):
        cache = engines[kv].engine.kv_cache
        assert cache.v is None and cache.v_scale is None, kv
        # a row: LORA codes, then the RoPE part's bf16 bytes; one bf16 scale per token
        assert cache.k.dtype == dtype and cache.k.shape[-1] == LORA + 2 * ROPE, kv
        assert cache.k_scale.shape == cache.k.shape[:-1]
        assert engines[kv].engine.stats().kv_bytes_per_token == 3 * (LORA + 2 + 2 * ROPE)
        assert not cache.spec.hadamard and cache.key_smoothing is None  # latents: neither


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_the_rope_part_of_1_byte_latent_pages_is_the_bf16_of_the_float_one(engines, kv):
    """Only c_kv is quantized: layer 0's k_pe (same inputs in both engines) is stored as its
    bf16 rounding, bit for bit, whatever the c_kv part's scale."""
    exact = prefilled_latents(engines["auto"])[0, :, LORA:]
    stored = prefilled_latents(engines[kv])[0, :, LORA:]
    assert torch.equal(stored, exact.to(torch.bfloat16).float())


# e4m3 keeps 3 mantissa bits: each element is within 1/16 of its token's largest magnitude;
# int8 within half a level (amax / 254), 1/200 with the bf16 scale's rounding
@pytest.mark.parametrize("kv,step", [("fp8", 16), ("int8", 200)])
def test_quantized_pages_are_the_quantized_latent(engines, kv, step):
    exact = prefilled_latents(engines["auto"])
    quantized = prefilled_latents(engines[kv])
    assert exact.abs().max() > 0.5
    # Layer 0's latents come from the same inputs in both engines (later layers' inputs went
    # through quantized attention).
    # the c_kv part: within a step of its own largest magnitude (the scale covers c_kv only)
    c_exact, c_quant = exact[0, :, :LORA], quantized[0, :, :LORA]
    bound = c_exact.abs().amax(dim=-1, keepdim=True) / step
    assert ((c_quant - c_exact).abs() <= bound).all()
    assert not torch.equal(c_quant, c_exact)  # quantized, not a float copy
    assert (quantized - exact).abs().max() < 0.25 * exact.abs().max()


def test_fp8_to_bf16_capacity_ratio_matches_the_planner(engines):
    reports = {kv: memory_report(engines[kv].memory_footprint()) for kv in ("bf16", "fp8", "int8")}
    for kv, report in reports.items():
        assert report.kv_bytes_per_token == report.planned_kv_bytes_per_token, kv
        assert report.kv_capacity_tokens == report.planned_kv_capacity_tokens, kv
        assert report.weight_bytes == report.planned_weight_bytes, kv
    ratio = engines["fp8"].kv_capacity_tokens / engines["bf16"].kv_capacity_tokens
    planned = (reports["fp8"].planned_kv_capacity_tokens
               / reports["bf16"].planned_kv_capacity_tokens)
    assert ratio == planned
    # 576 * 2 / (512 + 2 + 128) per token for DeepSeek-V3: ~1.79x; 96 / (32 + 2 + 32) here:
    # ~1.45x (the RoPE part is a third of this tiny latent)
    assert 1.4 < ratio < 1.5
    assert engines["int8"].kv_capacity_tokens == engines["fp8"].kv_capacity_tokens




# one row of each of three texts; measured 2026-12-02 (mean relative logit error, mean KL to
# float pages): one scale over the whole latent row, the old format: fp8 0.063 / 3.9e-3,
# int8 0.040 / 3.6e-3; c_kv scaled, RoPE part bf16: fp8 0.042 / 6.3e-4, int8 0.025 / 1.5e-3
QUALITY_PROMPTS = (PROMPT, "The history of the Roman empire begins with a small city on the "
                   "Tiber river in Italy", "Photosynthesis is the process by which green "
                   "plants turn light into chemical energy")
OLD_FORMAT = {"fp8": (0.063, 3.9e-3), "int8": (0.040, 3.6e-3)}


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_latent_pages_with_a_bf16_rope_part_score_closer_to_float_than_one_scale_rows(
        engines, kv):
    """Latents are never rotated (not a power-of-two size, and their first kv_lora_rank
    elements are read as values); with the RoPE part kept in bf16 and the scale over c_kv
    alone, both 1-byte formats are closer to float pages than the one-scale rows were."""
    errs, kls = [], []
    for prompt in QUALITY_PROMPTS:
        ids = engines["auto"].tokenizer.encode(prompt)
        ref = engines["auto"].prompt_logits(ids)
        got = engines[kv].prompt_logits(ids)
        errs.append((got - ref).norm(dim=-1) / ref.norm(dim=-1))
        kls.append(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1),
                                              log_target=True, reduction="none").sum(-1))
    err, kl = float(torch.cat(errs).mean()), float(torch.cat(kls).mean())
    old_err, old_kl = OLD_FORMAT[kv]
    assert err < 0.8 * old_err and kl < 0.5 * old_kl, (err, kl)


@pytest.mark.parametrize("kv", ["auto", "fp8", "int8"])
def test_decode_steps_over_latent_pages_pick_what_a_prefill_over_them_scores(engines, kv):
    """Decode steps read the latent pages through the decode op (C++ on CPU), prefill through
    the prefill path: over the same format, each greedy token is the scored row's argmax."""
    llm = engines[kv]
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([ids], params, tenant="decode")[0].outputs[0].token_ids
    scored = llm.prompt_logits(ids + tokens[:-1], tenant="score")[len(ids) - 1:]
    assert scored.argmax(-1).tolist() == tokens
