"""Key/value smoothing of FP8 KV pages (runtime/kv/smoothing.py): exact in attention (a key
shift moves every score of a query alike; channel scales cancel between q and k, and between
stored values and the output), calibrated on text the quality gate never scores, and cutting
the FP8 error it exists for."""

from __future__ import annotations

import pytest
import torch

from runtime.context import (
    AttentionMetadata,
    DecodeGroup,
    ForwardContext,
    PrefillSlice,
    forward_context,
)
from runtime.formats import KVFormat
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.kv.smoothing import KeySmoothing, calibration_windows
from runtime.models.layers import PagedAttention

HEADS, KV_HEADS, DIM, PAGE = 6, 2, 64, 16


def _attend(fmt: str, smoothing: KeySmoothing | None, q, k, v) -> torch.Tensor:
    """One layer's attention over fresh pages: a 40-token prefill, then one decode step."""
    spec = KVCacheSpec(1, KV_HEADS, DIM, PAGE, KVFormat(fmt))
    cache = KVCache(spec, 4, "cpu")
    cache.key_smoothing = smoothing
    attn = PagedAttention(0, HEADS, KV_HEADS, DIM)
    n = q.shape[0] - 1
    pages = torch.tensor([2, 0, 3])
    pos = torch.arange(n)
    pre = AttentionMetadata(pages[pos // PAGE] * PAGE + pos % PAGE, [],
                            [PrefillSlice(0, n, pages, n, None)])
    with forward_context(ForwardContext(pre, cache)):
        first = attn(q[:n], k[:n], v[:n])
    slot = pages[n // PAGE] * PAGE + n % PAGE
    dec = AttentionMetadata(slot.view(1), [DecodeGroup(0, 1, pages[None], torch.tensor([n + 1]))],
                            [])
    with forward_context(ForwardContext(dec, cache)):
        last = attn(q[n:], k[n:], v[n:])
    return torch.cat([first, last])


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_smoothed_quantized_layer_reads_what_it_was_given_and_the_mean_shift_helps(fmt):
    """Through PagedAttention (a prefill, then a decode step, both reading rotated fp8 or int8
    pages): with any channel scales the output is exact attention up to the format's rounding
    (a factor dropped on the way gives errors near 1); keys with a large per-channel constant,
    as the real model's low-frequency RoPE channels hold, lose most of their error with the
    mean subtracted."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(41, HEADS, DIM, generator=gen)
    offset = torch.zeros(DIM)
    offset[[22, 27, 54, 59]] = torch.tensor([9.0, -7.0, 8.0, 6.0])
    k = torch.randn(41, KV_HEADS, DIM, generator=gen) + offset
    v = torch.randn(41, KV_HEADS, DIM, generator=gen)
    exact = _attend("fp32", None, q, k, v)
    mean = k[1:].mean(0, keepdim=True)
    ones = torch.ones(1, KV_HEADS, DIM)
    scales = [torch.rand(1, KV_HEADS, DIM, generator=gen) * 2 + 0.5 for _ in range(2)]

    def error(smoothing: KeySmoothing | None) -> float:
        return float((_attend(fmt, smoothing, q, k, v) - exact).norm() / exact.norm())

    plain = error(None)
    assert error(KeySmoothing(mean, ones, ones)) < 0.8 * plain
    assert error(KeySmoothing(mean, *scales)) < (0.1 if fmt == "fp8" else 0.02)


def test_calibration_text_is_pydoc_not_the_held_out_text():
    windows = calibration_windows(lambda text: [ord(c) for c in text])
    assert len(windows) == 2 and all(len(w) == 256 for w in windows)
    text = "".join(chr(c) for c in windows[0])
    import pydoc_data.topics

    assert any(text[:64] in body for body in pydoc_data.topics.topics.values())


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_fp8_engine_calibrates_smoothing_and_other_formats_do_not(default_model_path):
    from runtime import LLM

    fp8 = LLM(kv_cache_bytes=8 << 20, kv_cache_dtype="fp8", gguf_weights="dequantize")
    ks = fp8.engine.kv_cache.key_smoothing
    assert ks is not None
    for t in ks:
        assert t.shape == (30, 3, 64) and torch.isfinite(t).all()
    assert torch.allclose(ks.scale.log().mean(-1), torch.zeros(30, 3), atol=1e-5)
    assert (ks.scale > 0).all() and (ks.v_scale > 0).all()
    bf16 = LLM(kv_cache_bytes=8 << 20, kv_cache_dtype="bf16", gguf_weights="dequantize")
    assert bf16.engine.kv_cache.key_smoothing is None
    # int8 pages: the one calibration, reused as it is (the same model, the same windows)
    int8 = LLM(kv_cache_bytes=8 << 20, kv_cache_dtype="int8", gguf_weights="dequantize")
    for a, b in zip(int8.engine.kv_cache.key_smoothing, ks, strict=True):
        assert torch.equal(a, b)
