"""MLA latent rows <-> frame payloads (DeepSeek-V3-style models: one latent row per token and
layer, no K and V per head; `runtime/kv/cache.py` has the row's layout).

A latent payload holds, per layer of its range, the listed tokens' rows as the sender stores
them, [tokens, row_width] of its page dtype (float pages: the latent_dim values; fp8 / int8
pages: kv_lora_rank codes then the RoPE part's bf16 bytes), then (fp8 and int8 only) their
scales, bf16 [tokens]. Latent pages are never rotated or smoothed, so nothing else travels.

At import a payload in the receiver's own format is copied byte for byte (rows and scales);
any other format is decoded to float32 latents (`kernels.dequantize_latent_rows`: c_kv times
its scale, the RoPE part exactly its bf16) and written through `kernels.store_latent`, the op
the model writes latents with, so the receiver's rows are the ones its own prefill would have
written from those values.
"""

from __future__ import annotations

import torch

from kernels import dequantize_latent_rows, store_latent
from runtime.formats import QUANTIZED_KV_FORMATS
from runtime.kv.cache import STORAGE_DTYPES, KVCache

SCALE_BYTES = 2  # bf16, one per token


def latent_row_width(fmt: str, latent_dim: int, rope_dim: int) -> int:
    """Elements of `fmt`'s storage dtype in one latent row: latent_dim, or kv_lora_rank codes
    plus the bf16 RoPE part's 2 * rope_dim bytes in the 1-byte formats."""
    return latent_dim + rope_dim if fmt in QUANTIZED_KV_FORMATS else latent_dim


def latent_token_bytes_per_layer(fmt: str, latent_dim: int, rope_dim: int) -> int:
    """Payload bytes of one token's latent row in one layer, its scale included (fp8 / int8)."""
    row = latent_row_width(fmt, latent_dim, rope_dim) * STORAGE_DTYPES[fmt].itemsize
    return row + (SCALE_BYTES if fmt in QUANTIZED_KV_FORMATS else 0)


def gather_latent_payload(cache: KVCache, layers: tuple[int, int], slots: torch.Tensor) -> bytes:
    """The payload of latent pages for `slots` (flat page_id * page_size + offset, in order)."""
    width = cache.spec.row_width
    slots = slots.to(cache.k.device)
    parts: list[bytes] = []
    for layer in range(*layers):
        kv = cache.layer(layer)
        rows = [kv.k.reshape(-1, width).index_select(0, slots)]
        if kv.k_scale is not None:
            rows.append(kv.k_scale.reshape(-1).index_select(0, slots))
        parts.extend(r.contiguous().cpu().view(torch.uint8).numpy().tobytes() for r in rows)
    return b"".join(parts)


def write_latent_payload(cache: KVCache, payload: bytes, src_format: str,
                         layers: tuple[int, int], slots: torch.Tensor) -> None:
    """Write a verified latent payload into `slots` of the receiver's latent pages, converting
    its format. Raises ValueError when the payload's size does not match its layers and
    tokens."""
    spec = cache.spec
    n = int(slots.numel())
    width = latent_row_width(src_format, spec.head_dim, spec.rope_dim)
    per_layer = latent_token_bytes_per_layer(src_format, spec.head_dim, spec.rope_dim) * n
    if len(payload) != per_layer * (layers[1] - layers[0]):
        raise ValueError(f"payload of {len(payload)} bytes for {n} tokens x "
                         f"{layers[1] - layers[0]} layers of {src_format} latent rows")
    dtype = STORAGE_DTYPES[src_format]
    quantized = src_format in QUANTIZED_KV_FORMATS
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    row_bytes = n * width * dtype.itemsize
    dev = cache.k.device
    slots = slots.to(dev)
    off = 0
    for layer in range(*layers):
        rows = buf[off : off + row_bytes].view(dtype).view(n, width)
        off += row_bytes
        scale = None
        if quantized:
            scale = buf[off : off + n * SCALE_BYTES].view(torch.bfloat16)
            off += n * SCALE_BYTES
        kv = cache.layer(layer)
        if src_format == spec.format.name:  # the bytes as they were
            kv.k.view(-1, width).index_copy_(0, slots, rows.to(dev))
            if kv.k_scale is not None and scale is not None:
                kv.k_scale.view(-1).index_copy_(0, slots, scale.to(dev))
            continue
        latent = (dequantize_latent_rows(rows, scale, spec.head_dim) if scale is not None
                  else rows.float())
        store_latent(latent.to(dev)[:, None].contiguous(), kv.k, slots, kv.k_scale)
