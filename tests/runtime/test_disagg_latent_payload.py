"""MLA latent pages through the KV transfer's payload, without a model: the rows a receiver
holds after an import are the ones it would have written itself from the sender's values."""

from __future__ import annotations

import pytest
import torch

from kernels import dequantize_latent_rows, store_latent
from runtime.disagg.codec import gather_payload, page_token_bytes_per_layer, write_payload
from runtime.formats import KVFormat
from runtime.kv.cache import KVCache, KVCacheSpec

LAYERS, LORA, ROPE = 3, 32, 16
LATENT = LORA + ROPE


def _cache(fmt: str, pages: int = 6) -> KVCache:
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=1, head_dim=LATENT, page_size=4,
                       format=KVFormat(fmt), latent=True, rope_dim=ROPE)
    cache = KVCache(spec, pages, "cpu")
    cache.k.fill_(0x7F if spec.quantized else float("nan"))  # poison: an unwritten row shows up
    if cache.k_scale is not None:
        cache.k_scale.fill_(float("nan"))
    return cache


def _fill(cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """Random latents (heavy-tailed c_kv, a RoPE part of another range) through the model's
    write path; returns them, [layers, tokens, latent_dim]."""
    n = slots.numel()
    latents = torch.randn(LAYERS, n, LATENT) * torch.rand(LAYERS, n, 1) * 20
    latents[..., LORA:] *= 0.05
    for layer in range(LAYERS):
        kv = cache.layer(layer)
        store_latent(latents[layer][:, None], kv.k, slots, kv.k_scale)
    return latents


def _rows(cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The float32 latents [tokens, latent_dim] that `slots` of a layer hold."""
    kv = cache.layer(layer)
    rows = kv.k.reshape(-1, cache.spec.row_width)[slots]
    if kv.k_scale is None:
        return rows.float()
    return dequantize_latent_rows(rows, kv.k_scale.reshape(-1)[slots], LATENT)


PAIRS = [("bf16", "bf16"), ("fp8", "fp8"), ("int8", "int8"), ("fp32", "fp8"), ("bf16", "fp8"),
         ("bf16", "int8"), ("fp8", "bf16"), ("int8", "fp32"), ("fp8", "int8")]


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_latent_import_equals_the_decode_side_writing_the_same_values_itself(src, dst):
    src_slots = torch.tensor([5, 6, 7, 8, 9, 12, 13])  # odd count, across pages
    dst_slots = torch.tensor([20, 21, 22, 23, 0, 1, 2])
    sender, receiver, reference = _cache(src), _cache(dst), _cache(dst)
    _fill(sender, src_slots)
    payload = gather_payload(sender, (0, LAYERS), src_slots)
    assert len(payload) == LAYERS * 7 * page_token_bytes_per_layer(sender.spec)
    write_payload(receiver, payload, src, (0, LAYERS), dst_slots)
    for layer in range(LAYERS):
        s, r = sender.layer(layer), reference.layer(layer)
        if src == dst:  # same format: byte copies of the rows and their scales
            r.k.reshape(-1, sender.spec.row_width)[dst_slots] = \
                s.k.reshape(-1, sender.spec.row_width)[src_slots]
            if s.k_scale is not None:
                r.k_scale.reshape(-1)[dst_slots] = s.k_scale.reshape(-1)[src_slots]
        else:
            store_latent(_rows(sender, layer, src_slots)[:, None], r.k, dst_slots, r.k_scale)
    assert torch.equal(receiver.k.view(torch.uint8), reference.k.view(torch.uint8))
    if receiver.k_scale is not None:
        assert torch.equal(receiver.k_scale.view(torch.uint8),
                           reference.k_scale.view(torch.uint8))


@pytest.mark.parametrize(("src", "dst"), [("bf16", "fp8"), ("fp8", "bf16"), ("int8", "fp8")])
def test_the_rope_part_crosses_every_format_change_as_its_bf16(src, dst):
    """1-byte latent rows keep the RoPE part in bf16: a transfer between any two of the formats
    (bf16 or better on both ends of the RoPE part) carries it exactly; the c_kv part within the
    1-byte format's rounding."""
    src_slots, dst_slots = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([9, 10, 11, 0, 3])
    sender, receiver = _cache(src), _cache(dst)
    want = _fill(sender, src_slots)
    write_payload(receiver, gather_payload(sender, (0, LAYERS), src_slots), src, (0, LAYERS),
                  dst_slots)
    for layer in range(LAYERS):
        got = _rows(receiver, layer, dst_slots)
        assert torch.equal(got[:, LORA:], want[layer, :, LORA:].bfloat16().float())
        err = (got[:, :LORA] - want[layer, :, :LORA]).norm(dim=-1)
        assert float((err / want[layer, :, :LORA].norm(dim=-1)).max()) < 0.1


def test_a_latent_payload_of_the_wrong_size_is_refused():
    cache = _cache("fp8")
    with pytest.raises(ValueError, match="latent rows"):
        write_payload(cache, b"\x00" * 100, "bf16", (0, 1), torch.tensor([0, 1]))
