"""KV transfer frames, the page retag, and the import format change, without a model."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import dequantize_kv, store_kv
from kernels.hadamard import fwht
from runtime.disagg import frames as wire
from runtime.disagg.codec import (
    gather_payload,
    smoothing_bytes_per_layer,
    token_bytes_per_layer,
    write_payload,
)
from runtime.disagg.export import _chunks
from runtime.formats import KVFormat
from runtime.kv.cache import KVCache, KVCacheSpec
from runtime.kv.pages import PageAccountingError, PagePool
from runtime.kv.smoothing import KeySmoothing


def _frame() -> wire.Frame:
    payload = bytes(random.getrandbits(8) for _ in range(300))
    return wire.pages_frame("req-1", 3, (2, 5), [0, 1, 4], payload)


def test_frame_round_trips():
    frame = _frame()
    back = wire.decode(wire.encode(frame))
    assert back == frame
    assert (back.layers, back.pages) == ((2, 5), [0, 1, 4])


def test_every_flipped_bit_position_is_caught():
    data = wire.encode(_frame())
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(wire.FrameError):
            wire.decode(bytes(bad))


@pytest.mark.parametrize("cut", [0, 1, 10, -1])
def test_truncated_frames_are_refused(cut):
    data = wire.encode(_frame())
    with pytest.raises(wire.FrameError):
        wire.decode(data[:cut])


def test_oversized_and_foreign_frames_are_refused():
    with pytest.raises(wire.FrameError, match="limit"):
        wire.decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))
    import msgpack

    with pytest.raises(wire.FrameError):
        wire.decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(wire.FrameError):  # a valid frame of another version
        wire.decode(wire.encode(_frame()).replace(b"\xa1v\x01", b"\xa1v\x02", 1))


def test_pages_frame_needs_sane_positions():
    for layers, pages in [((3, 3), [0]), ((0, 2), []), ((0, 2), [1, 1]), ((0, 2), [-1])]:
        frame = wire.Frame("pages", "r", 1, {"layers": list(layers), "pages": pages}, b"x")
        with pytest.raises(wire.FrameError):
            wire.decode(wire.encode(frame))


def test_retag_gives_a_fresh_generation_only_to_a_page_held_once():
    pool = PagePool(4, 16)
    ref = pool.allocate("t")
    new = pool.retag(ref)
    assert new.page_id == ref.page_id and new.tag == ref.tag + 1
    assert not pool.is_live(ref) and pool.is_live(new)
    with pytest.raises(PageAccountingError):
        pool.retag(ref)  # stale
    pool.share(new)
    with pytest.raises(PageAccountingError):
        pool.retag(new)  # two holders: someone may have recorded it
    pool.release(new)
    pool.release(new)
    pool.check_quiescent()


@pytest.mark.parametrize("budget", [1, 3000, 20000, 1 << 30])
def test_chunks_cover_every_layer_and_page_once_within_budget(budget):
    page_layer_bytes = 1000
    seen = []
    for (lo, hi), pages in _chunks(7, 2, 9, page_layer_bytes, budget):
        assert (hi - lo) * len(pages) * page_layer_bytes <= max(budget, page_layer_bytes)
        seen += [(layer, p) for layer in range(lo, hi) for p in pages]
    assert sorted(seen) == [(layer, p) for layer in range(7) for p in range(2, 9)]


def _cache(fmt: str, pages: int = 6) -> KVCache:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4,
                       format=KVFormat(fmt))
    return KVCache(spec, pages, "cpu")


def _fill(cache: KVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random K/V (heavy-tailed, as activations are) through the model's write path."""
    n = slots.numel()
    ks = torch.randn(3, n, 2, 8) * torch.rand(3, n, 2, 1) * 20
    vs = torch.randn(3, n, 2, 8)
    for layer in range(3):
        kv = cache.layer(layer)
        store_kv(ks[layer], vs[layer], kv.k, kv.v, slots, kv.k_scale, kv.v_scale, kv.hadamard,
                 kv.k_shift, kv.k_channel_scale, kv.v_channel_scale)
    return ks, vs


@pytest.mark.parametrize(("src", "dst"), [("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "fp8"),
                                          ("fp32", "fp8"), ("bf16", "fp8"), ("fp32", "bf16"),
                                          ("fp8", "fp32"), ("fp8", "bf16"), ("int8", "int8"),
                                          ("fp32", "int8"), ("bf16", "int8"), ("int8", "fp32"),
                                          ("int8", "bf16")])
def test_import_equals_the_decode_side_writing_the_same_values_itself(src, dst):
    src_slots = torch.tensor([5, 6, 7, 8, 9, 12, 13])  # odd count, across pages
    dst_slots = torch.tensor([20, 21, 22, 23, 0, 1, 2])
    sender, receiver, reference = _cache(src), _cache(dst), _cache(dst)
    for c in (receiver, reference):  # poison: an unwritten slot shows up
        c.k.fill_(0x7F if c.spec.quantized else float("nan"))
    _fill(sender, src_slots)
    payload = gather_payload(sender, (0, 3), src_slots)
    assert len(payload) == 3 * (7 * token_bytes_per_layer(src, 2, 8)
                                + smoothing_bytes_per_layer(src, 2, 8))
    write_payload(receiver, payload, src, (0, 3), dst_slots)
    # The reference: the values as the sender holds them, written by the receiver's own op.
    for layer in range(3):
        s, r = sender.layer(layer), reference.layer(layer)
        k = s.k.view(2, -1, 8)[:, src_slots]
        v = s.v.view(2, -1, 8)[:, src_slots]
        if sender.spec.quantized:
            k = dequantize_kv(k, s.k_scale.view(2, -1)[:, src_slots])
            v = dequantize_kv(v, s.v_scale.view(2, -1)[:, src_slots])
            if s.hadamard:  # rotated pages: the values they stand for
                k, v = fwht(k), fwht(v)
        if src == dst:  # same format: byte copies
            for a, b in ((r.k, s.k), (r.v, s.v), (r.k_scale, s.k_scale), (r.v_scale, s.v_scale)):
                if a is not None:
                    flat_a = a.view(2, a[0].numel() // (8 if a.dim() == 4 else 1), -1)
                    flat_b = b.view(2, b[0].numel() // (8 if b.dim() == 4 else 1), -1)
                    flat_a[:, dst_slots] = flat_b[:, src_slots]
        else:
            store_kv(k.float().transpose(0, 1).contiguous(), v.float().transpose(0, 1).contiguous(),
                     r.k, r.v, dst_slots, r.k_scale, r.v_scale, r.hadamard)
    for a, b in ((receiver.k, reference.k), (receiver.v, reference.v),
                 (receiver.k_scale, reference.k_scale), (receiver.v_scale, reference.v_scale)):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _smoothed(cache: KVCache, seed: int) -> KVCache:
    if cache.spec.quantized:
        gen = torch.Generator().manual_seed(seed)
        cache.key_smoothing = KeySmoothing(torch.randn(3, 2, 8, generator=gen) * 4,
                                           torch.rand(3, 2, 8, generator=gen) + 0.5,
                                           torch.rand(3, 2, 8, generator=gen) + 0.5)
    return cache


@pytest.mark.parametrize(("src", "dst"), [("fp8", "fp32"), ("fp32", "fp8"), ("fp8", "fp8"),
                                          ("int8", "fp32"), ("fp32", "int8"), ("int8", "int8")])
@pytest.mark.parametrize("smoothing", ["none", "same", "different"])
def test_imported_kv_reads_back_as_the_values_the_sender_wrote(src, dst, smoothing):
    """Through rotated (and smoothed) FP8 or INT8 pages on either side: what the receiver's
    attention would read (pages decoded, rotated back, smoothing undone) is the sender's K/V
    within e4m3 / int8 rounding, never a rotated or shifted copy."""
    src_slots, dst_slots = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([12, 13, 14, 15, 0])
    sender, receiver = _cache(src), _cache(dst)
    if smoothing != "none":
        _smoothed(sender, 0)
        _smoothed(receiver, 0 if smoothing == "same" else 1)
    assert sender.spec.hadamard or receiver.spec.hadamard  # rotation is on for 1-byte pages
    ks, vs = _fill(sender, src_slots)
    write_payload(receiver, gather_payload(sender, (0, 3), src_slots), src, (0, 3), dst_slots)
    for layer in range(3):
        kv = receiver.layer(layer)
        for want, pages, scale in ((ks[layer], kv.k, kv.k_scale), (vs[layer], kv.v, kv.v_scale)):
            got = pages.view(2, -1, 8)[:, dst_slots]
            if scale is not None:
                got = dequantize_kv(got, scale.view(2, -1)[:, dst_slots])
                got = fwht(got) if kv.hadamard else got
                if kv.k_shift is not None:  # undo the receiver's own smoothing
                    if pages is kv.k:
                        got = got * kv.k_channel_scale[:, None] + kv.k_shift[:, None]
                    else:
                        got = got * kv.v_channel_scale[:, None]
            # what e4m3 rounded: the row, or the row minus a shift (either side's)
            size = want.norm(dim=-1) + sum(c.key_smoothing.shift[layer].norm(dim=-1)
                                           for c in (sender, receiver)
                                           if c.key_smoothing is not None and pages is kv.k)
            err = (got.transpose(0, 1) - want).norm(dim=-1) / size
            # e4m3 (3 mantissa bits) < 0.1, int8 (both ends int8 or float) < 0.02; a rotated
            # copy: ~1
            assert float(err.max()) < (0.1 if "fp8" in (src, dst) else 0.02)


def test_import_refuses_a_payload_of_the_wrong_size():
    cache = _cache("fp8")
    with pytest.raises(ValueError, match="payload"):
        write_payload(cache, b"\x00" * 100, "fp32", (0, 1), torch.tensor([0, 1]))


def test_frame_ring_moves_frames_in_order_with_backpressure():
    from runtime.disagg.shm import FrameRing

    ring = FrameRing.create(slots=2, slot_bytes=64)
    sender = FrameRing.attach(ring.name)
    try:
        assert (sender.slots, sender.slot_bytes) == (2, 64)
        assert sender.try_put(b"a" * 10) == 0 and sender.try_put(b"b" * 64) == 1
        assert sender.try_put(b"c") is None  # both slots in flight: the sender waits
        with pytest.raises(wire.FrameError):
            ring.take(1, 64)  # out of order
        assert ring.take(0, 10) == b"a" * 10
        assert sender.try_put(b"c") == 0
        assert ring.take(1, 64) == b"b" * 64 and ring.take(0, 1) == b"c"
        with pytest.raises(wire.FrameError):
            sender.try_put(b"x" * 65)  # over a slot: the caller sends it in the stream
        with pytest.raises(wire.FrameError):
            ring.take(1, 65)
    finally:
        sender.close()
        ring.close()
    with pytest.raises(FileNotFoundError):
        FrameRing.attach(ring.name)  # the owner unlinked it
