"""Key smoothing for quantized (FP8 and INT8) KV pages: a calibrated per-(layer, KV head,
channel) key mean is subtracted from every key before it is rotated and quantized.

Softmax is shift-invariant per query: q.(k - mu) = q.k - q.mu, and q.mu is the same for every
key a query attends to, so attention is unchanged exactly; only what e4m3 has to represent
shrinks. The post-RoPE keys of this model family carry large, slowly rotating values in their
low-frequency RoPE channels (issue 17's error analysis,
ops/bench/RESULTS-log.md#fp8-kv-what-was-tried-on-the-same-24-windows), mostly a constant
part that the mean removes. The method is SageAttention's "smooth K" (Zhang et al., 2024,
"SageAttention: Accurate 8-Bit Attention for Plug-and-play Inference Acceleration", sec. 4.2),
with the mean calibrated once per model instead of per block (pages are quantized when written,
before the rest of the sequence exists); KIVI (Liu et al., 2024) motivates treating K per
channel for the same outliers. The mean is calibrated on Python's own documentation
(`pydoc_data.topics`), never on the held-out text the quality gate scores.
"""

from __future__ import annotations

import pydoc_data.topics
from typing import Any

import torch
from torch import nn

from runtime.context import AttentionMetadata, ForwardContext, PrefillSlice, forward_context
from runtime.formats import KVFormat
from runtime.kv.cache import KeySmoothing, KVCache, KVCacheSpec

# NOTE: on for FP8 and INT8 K/V pages (not MLA latents, not tensor-parallel engines), one
# calibration for both formats: the quality gate's numbers for it are in
# ops/bench/RESULTS.md#kv-format-quality.
SMOOTH_FP8_KEYS = True
SCALE_FP8_KEYS = True
SCALE_FP8_VALUES = True
KEY_SCALE_STRENGTH = 0.5  # key scale (rms k / rms q) ** strength; 0.5 balances the two
VALUE_SCALE_STRENGTH = 0.5  # value scale (rms v) ** strength

# Windows of calibration tokens (position 0 of each, the attention sink, is left out of the mean).
CALIBRATION_WINDOWS = 2
CALIBRATION_WINDOW_TOKENS = 256


def calibration_windows(encode, windows: int = CALIBRATION_WINDOWS,
                        window_tokens: int = CALIBRATION_WINDOW_TOKENS) -> list[list[int]]:
    """`windows` runs of `window_tokens` ids from the pydoc topics, each starting at a topic
    evenly spaced over their sorted names."""
    topics = pydoc_data.topics.topics
    names = sorted(topics)
    # NOTE: tokenize only a few kB per window (the whole text is ~1 MB: seconds to encode)
    out = []
    for i in range(windows):
        first, text = i * len(names) // windows, ""
        for name in names[first:]:
            text += topics[name] + "\n\n"
            if len(text) >= window_tokens * 8:  # ~4 characters a token: twice enough
                break
        out.append(encode(text)[:window_tokens])
    return out


@torch.inference_mode()
def calibrate_key_smoothing(model: nn.Module, num_layers: int, num_kv_heads: int,
                            head_dim: int, windows: list[list[int]], device: torch.device,
                            backend: Any = None) -> KeySmoothing:
    """Key means and per-channel scales from `windows` run through `model` (whose attention
    layers are `PagedAttention`) on a scratch float32 KV cache; positions 0 are left out.

    scale_c = sqrt(rms(k_c - shift_c) / rms(q_c)) (q over the KV head's query group),
    normalised to geometric mean 1: it minimises ||q * scale|| * ||(k - shift) / scale||, which
    bounds the score error of a rotated row quantized with one amax scale (SmoothQuant's
    migration strength 0.5, Xiao et al. 2023, between queries and keys). Without
    SCALE_FP8_KEYS the scale is 1."""
    from runtime.models.layers import PagedAttention

    shape = (num_layers, num_kv_heads, head_dim)
    k_sum, k_sq, q_sq, v_sq = (torch.zeros(shape, dtype=torch.float64) for _ in range(4))
    count = 0
    page_size = 16
    pages = -(-max(len(w) for w in windows) // page_size)
    spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, page_size, KVFormat("fp32"))
    scratch = KVCache(spec, pages, device)

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        q, k = args[0][1:].double().cpu(), args[1][1:].double().cpu()  # after RoPE
        v = args[2][1:].double().cpu()
        layer = module.layer_index
        v_sq[layer] += v.square().sum(0)
        k_sum[layer] += k.sum(0)
        k_sq[layer] += k.square().sum(0)
        q_sq[layer] += q.view(q.shape[0], num_kv_heads, -1, head_dim).square().mean(2).sum(0)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()
             if isinstance(m, PagedAttention)]
    try:
        for window in windows:
            n = len(window)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, device=device), decodes=[],
                prefills=[PrefillSlice(0, n, torch.arange(pages, device=device), n, None)])
            with forward_context(ForwardContext(meta, scratch, backend)):
                model(torch.tensor(window, device=device), torch.arange(n, device=device))
            count += n - 1
    finally:
        for h in hooks:
            h.remove()
    count = max(count, 1)
    shift = k_sum / count
    scale = torch.ones(shape, dtype=torch.float64)
    if SCALE_FP8_KEYS:
        k_rms = (k_sq / count - shift.square()).clamp_min(0).sqrt()
        q_rms = (q_sq / count).sqrt()
        ratio = (k_rms.clamp_min(1e-6) / q_rms.clamp_min(1e-6)).pow(KEY_SCALE_STRENGTH)
        scale = ratio / ratio.log().mean(-1, keepdim=True).exp()
    v_scale = torch.ones(shape, dtype=torch.float64)
    if SCALE_FP8_VALUES:
        v_root_rms = (v_sq / count).clamp_min(1e-12).sqrt().pow(VALUE_SCALE_STRENGTH)
        v_scale = v_root_rms / v_root_rms.log().mean(-1, keepdim=True).exp()
    return KeySmoothing(*(t.float().to(device) for t in (shift, scale, v_scale)))
