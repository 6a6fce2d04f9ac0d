"""The engine over INT8 KV pages (symmetric, a bf16 scale per token and KV head, rotated and
smoothed as fp8 pages are): capacity, teacher-forced agreement and greedy parity with float32
KV, prefix hits, and batch independence."""

from __future__ import annotations

import importlib
import pydoc_data.topics

import pytest
import torch

from kernels.ops import twin_ops
from ops.planner.engine import memory_report
from runtime import LLM, SamplingParams
from tests.helpers import capture_logits

pytestmark = pytest.mark.slow

BUDGET = 48 << 20
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "List three prime numbers:", "The quick brown fox", "In 1492, Columbus"]


@pytest.fixture(scope="module")
def int8_llm():
    # NOTE: dequantized weights, as the shared fp32 `llm` (see test_kv_cache_dtype.py's fp8_llm)
    return LLM(kv_cache_bytes=BUDGET, kv_cache_dtype="int8", max_num_seqs=16,
               gguf_weights="dequantize")


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    ref, got = torch.log_softmax(ref, dim=-1), torch.log_softmax(got, dim=-1)
    return (ref.exp() * (ref - got)).sum(-1)


def test_int8_engine_allocates_int8_pages_in_fp8_bytes(int8_llm):
    cache = int8_llm.engine.kv_cache
    assert cache.k.dtype == cache.v.dtype == torch.int8
    assert cache.k_scale.dtype == torch.bfloat16 and cache.k_scale.shape == cache.k.shape[:-1]
    assert cache.spec.hadamard and cache.key_smoothing is not None  # as fp8 pages are
    report = memory_report(int8_llm.memory_footprint())
    assert report.kv_bytes_per_token == report.planned_kv_bytes_per_token == 30 * 2 * 3 * 66
    assert report.kv_capacity_tokens == int8_llm.kv_capacity_tokens
    assert report.kv_capacity_tokens == report.planned_kv_capacity_tokens
    assert int8_llm.serving_formats.kv.name == "int8"
    bf16_tokens = BUDGET // (30 * 2 * 3 * 64 * 2) // 16 * 16
    assert int8_llm.kv_capacity_tokens / bf16_tokens >= 1.9


@pytest.mark.usefixtures("one_torch_thread")
def test_int8_kv_next_token_distributions_stay_close_to_fp32(llm, int8_llm):
    text = pydoc_data.topics.topics["assert"] + pydoc_data.topics.topics["for"]
    ids = llm.tokenizer.encode(text)[:384]
    ref, got = llm.prompt_logits(ids), int8_llm.prompt_logits(ids)
    kl = _kl(ref, got)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    # Measured on this text (2026-12-01): mean KL 1.1e-4, top-1 1.0; FP8 KV: 2.9e-3 and 0.990.
    assert kl.mean().item() < 1e-3, kl.mean()
    assert top1 >= 0.98, top1
    assert torch.isfinite(got).all()


@pytest.mark.usefixtures("one_torch_thread")
def test_int8_greedy_output_matches_float_kv(llm, int8_llm, monkeypatch):
    """48 greedy tokens per prompt, int8 KV vs float32 KV (same weights). Measured 2026-12-01:
    all six identical over 48 tokens (first divergences at 49 and 53 of 64 on two prompts, where
    FP8 KV already parts at 8 and 19 on two others). Where a prompt parts, the float32 run's
    logits must show a near tie there (gap < 1): rounding, not a misread page."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    captured = capture_logits(llm.engine, monkeypatch)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    rows = list(captured.values())  # in request order
    got = [o.outputs[0].token_ids for o in int8_llm.generate(PROMPTS, params)]
    parted = {}
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        first = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is not None:
            row = rows[i][first]
            parted[PROMPTS[i]] = (first, float(row[a[first]] - row[b[first]]))
    print(f"\nint8 vs float32 KV, 48 greedy tokens: {len(PROMPTS) - len(parted)}/{len(PROMPTS)} "
          f"identical; (first divergence, fp32 logit gap): {parted}")
    assert len(parted) <= 1, parted
    assert all(0 <= gap < 1.0 for _, gap in parted.values()), parted
    int8_llm.engine.check_quiescent()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("path", ["cpp", "twin"])
@pytest.mark.parametrize("remaining", [2, 1])
def test_int8_prefix_hit_samples_what_a_whole_prefill_scores(int8_llm, monkeypatch, path,
                                                            remaining):
    """Rotated, smoothed INT8 pages written by one request's whole prefill, read by the next
    through a prefix hit of three pages; the tail (2 tokens: a masked prefill chunk; 1 token:
    the decode op) is recomputed on the C++ ops or their torch twins. As with FP8
    (test_kv_cache_dtype.py), the tail's K/V come from GEMMs over fewer rows and may re-round
    a step away: close in distribution. A page read unrotated or unscaled gives KL > 1."""
    if path == "twin":
        for name in ("kernels.paged_attention", "kernels.store_kv", "kernels.kv_fp8"):
            monkeypatch.setattr(importlib.import_module(name), "native_ops", twin_ops)
    topic = "assert" if remaining == 2 else "raise"
    tenant = f"hit-{path}-{remaining}"
    ids = int8_llm.tokenizer.encode(pydoc_data.topics.topics[topic])[: 48 + remaining]
    scored = int8_llm.prompt_logits(ids, tenant=tenant)  # whole prefill; leaves 3 cached pages
    captured = capture_logits(int8_llm.engine, monkeypatch)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (hit,) = int8_llm.generate([ids], params, tenant=tenant)
    assert hit.num_cached_tokens == 48
    (whole,) = int8_llm.generate([ids], params, tenant=tenant + "-cold")
    assert whole.num_cached_tokens == 0
    (hit_row, *_), (whole_row, *_) = captured.values()  # in request order
    torch.testing.assert_close(whole_row, scored[-1], atol=1e-4, rtol=1e-4)
    kl = float(_kl(scored[-1], hit_row))
    print(f"\nint8 prefix hit ({path}, {remaining} left): KL {kl:.2e} vs the whole prefill")
    # measured 2026-12-01: 3.4e-6 (2 left), 2e-7 (1 left); FP8 pages: up to 1.7e-3
    assert kl < 1e-4
    assert hit_row.argmax() == scored[-1].argmax()
    int8_llm.engine.check_quiescent()


@pytest.mark.usefixtures("one_torch_thread")
def test_int8_greedy_output_does_not_depend_on_batch_neighbours(int8_llm):
    """Scales are per token and head, fixed when the token is written: batching and chunking
    change nothing a sequence reads."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    alone = [int8_llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    together = [o.outputs[0].token_ids for o in int8_llm.generate(PROMPTS[:4], params)]
    assert together == alone
    int8_llm.engine.check_quiescent()
