"""KV rows <-> frame payloads, and the format change at import.

A payload holds, per layer of its range, K then V of the listed tokens as [kv_heads, tokens,
head_dim] in the sender's KV storage format, then (fp8 and int8 only) K then V scales as bf16
[kv_heads, tokens] and the sender's smoothing of that layer (runtime/kv/smoothing.py: key
shift, key and value channel scales, float32 [kv_heads, head_dim] each; 0 / 1 / 1 when it has
none). Only valid tokens travel: a page's unused tail (stale bytes from its previous life)
never leaves the sender.

At import, a payload in the receiver's own format is copied byte for byte; any other format is
decoded to float32 and written through `kernels.store_kv`, the same op the model writes KV
with, so FP8 or INT8 pages imported from fp32 / bf16 KV are bit-identical to the pages the
decode engine would have written itself from the same values. Quantized (fp8 / int8) pages
hold Hadamard-rotated K/V where the spec says so (`KVCacheSpec.hadamard`): a quantized payload
is rotated back after decoding, and `store_kv` rotates what it writes into the receiver's
rotated pages. Both ends run one build, so a quantized payload copied byte for byte is rotated
on both sides or on neither; it is copied only when both sides' format and smoothing are the
same, else decoded, unsmoothed and written again.

MLA latent pages (no V, never rotated or smoothed) have their own payload:
`runtime/disagg/latent.py`; `gather_payload` and `write_payload` pick it from the cache's spec.
"""

from __future__ import annotations

import torch

from kernels import dequantize_kv, store_kv
from kernels.hadamard import fwht
from runtime.disagg.latent import (
    gather_latent_payload,
    latent_token_bytes_per_layer,
    write_latent_payload,
)
from runtime.formats import QUANTIZED_KV_FORMATS
from runtime.kv.cache import STORAGE_DTYPES, KVCache, KVCacheSpec, LayerKV, quantized_pages_rotated


def token_bytes_per_layer(fmt: str, num_kv_heads: int, head_dim: int) -> int:
    """Payload bytes of one token in one layer: K and V, and their scales for fp8 / int8."""
    elem = STORAGE_DTYPES[fmt].itemsize
    scales = 2 * 2 * num_kv_heads if fmt in QUANTIZED_KV_FORMATS else 0
    return 2 * num_kv_heads * head_dim * elem + scales


def page_token_bytes_per_layer(spec: KVCacheSpec) -> int:
    """Payload bytes of one token in one layer of `spec`'s pages (K/V or an MLA latent row),
    without the per-layer smoothing."""
    fmt = spec.format.name
    if spec.latent:
        return latent_token_bytes_per_layer(fmt, spec.head_dim, spec.rope_dim)
    return token_bytes_per_layer(fmt, spec.num_kv_heads, spec.head_dim)


def smoothing_bytes_per_layer(fmt: str, num_kv_heads: int, head_dim: int) -> int:
    """Payload bytes of one layer's smoothing, whatever the token count (fp8 / int8 only)."""
    return 3 * num_kv_heads * head_dim * 4 if fmt in QUANTIZED_KV_FORMATS else 0


def _layer_smoothing(kv: LayerKV, heads: int, dim: int) -> list[torch.Tensor]:
    """[shift, k_channel_scale, v_channel_scale] of a layer, identity where it has none."""
    zero, one = torch.zeros(heads, dim), torch.ones(heads, dim)
    picked = (kv.k_shift, kv.k_channel_scale, kv.v_channel_scale)
    return [d if t is None else t.float().cpu() for t, d in zip(picked, (zero, one, one),
                                                               strict=True)]


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def gather_payload(cache: KVCache, layers: tuple[int, int], slots: torch.Tensor) -> bytes:
    """The payload for `slots` (flat page_id * page_size + offset, in token order)."""
    spec = cache.spec
    if spec.latent:
        return gather_latent_payload(cache, layers, slots)
    heads, dim = spec.num_kv_heads, spec.head_dim
    slots = slots.to(cache.k.device)
    parts: list[bytes] = []
    for layer in range(*layers):
        kv = cache.layer(layer)
        rows = [t.view(heads, -1, dim).index_select(1, slots) for t in (kv.k, kv.v)]
        if kv.k_scale is not None and kv.v_scale is not None:
            rows += [s.view(heads, -1).index_select(1, slots) for s in (kv.k_scale, kv.v_scale)]
            rows += _layer_smoothing(kv, heads, dim)
        parts.extend(_to_bytes(r) for r in rows)
    return b"".join(parts)


def write_payload(cache: KVCache, payload: bytes, src_format: str, layers: tuple[int, int],
                  slots: torch.Tensor) -> None:
    """Write a verified payload into `slots` of the receiver's cache, converting its format.

    Raises ValueError when the payload's size does not match its layers and tokens."""
    spec: KVCacheSpec = cache.spec
    if spec.latent:
        write_latent_payload(cache, payload, src_format, layers, slots)
        return
    heads, dim, n = spec.num_kv_heads, spec.head_dim, int(slots.numel())
    smooth_bytes = smoothing_bytes_per_layer(src_format, heads, dim)
    per_layer = token_bytes_per_layer(src_format, heads, dim) * n + smooth_bytes
    if len(payload) != per_layer * (layers[1] - layers[0]):
        raise ValueError(f"payload of {len(payload)} bytes for {n} tokens x "
                         f"{layers[1] - layers[0]} layers of {src_format}")
    dtype = STORAGE_DTYPES[src_format]
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    data_bytes = heads * n * dim * dtype.itemsize
    scale_bytes = heads * n * 2
    slots = slots.to(cache.k.device)
    off = 0
    for layer in range(*layers):
        k = buf[off : off + data_bytes].view(dtype).view(heads, n, dim)
        v = buf[off + data_bytes : off + 2 * data_bytes].view(dtype).view(heads, n, dim)
        off += 2 * data_bytes
        ks = vs = None
        smooth: list[torch.Tensor] | None = None
        if src_format in QUANTIZED_KV_FORMATS:
            ks = buf[off : off + scale_bytes].view(torch.bfloat16).view(heads, n)
            vs = buf[off + scale_bytes : off + 2 * scale_bytes].view(torch.bfloat16).view(heads, n)
            off += 2 * scale_bytes
            smooth = list(buf[off : off + smooth_bytes].view(torch.float32).view(3, heads, dim))
            off += smooth_bytes
        _write_layer(cache, layer, src_format, k, v, ks, vs, slots, smooth)


def _write_layer(cache: KVCache, layer: int, src_format: str, k: torch.Tensor, v: torch.Tensor,
                 ks: torch.Tensor | None, vs: torch.Tensor | None, slots: torch.Tensor,
                 smooth: list[torch.Tensor] | None) -> None:
    spec = cache.spec
    heads, dim = spec.num_kv_heads, spec.head_dim
    kv = cache.layer(layer)
    dev = cache.k.device
    same_smoothing = smooth is None or all(
        torch.equal(a, b) for a, b in zip(smooth, _layer_smoothing(kv, heads, dim), strict=True))
    if src_format == spec.format.name and same_smoothing:  # the bytes as they were
        kv.k.view(heads, -1, dim).index_copy_(1, slots, k.to(dev))
        kv.v.view(heads, -1, dim).index_copy_(1, slots, v.to(dev))
        if kv.k_scale is not None and kv.v_scale is not None and ks is not None \
                and vs is not None:
            kv.k_scale.view(heads, -1).index_copy_(1, slots, ks.to(dev))
            kv.v_scale.view(heads, -1).index_copy_(1, slots, vs.to(dev))
        return
    if src_format in QUANTIZED_KV_FORMATS:
        assert ks is not None and vs is not None
        kf, vf = dequantize_kv(k, ks), dequantize_kv(v, vs)
        if quantized_pages_rotated(dim, spec.latent):  # the sender's pages held the rotated rows
            kf, vf = fwht(kf), fwht(vf)
        if smooth is not None:  # undo the sender's smoothing: [heads, tokens, dim]
            shift, k_div, v_div = (t[:, None] for t in smooth)
            kf, vf = kf * k_div + shift, vf * v_div
    else:
        kf, vf = k.float(), v.float()
    # store_kv takes [tokens, kv_heads, dim]
    store_kv(kf.to(dev).transpose(0, 1).contiguous(), vf.to(dev).transpose(0, 1).contiguous(),
             kv.k, kv.v, slots, kv.k_scale, kv.v_scale, kv.hadamard, kv.k_shift,
             kv.k_channel_scale, kv.v_channel_scale)
