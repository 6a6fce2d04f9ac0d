"""The Triton store kernel (kernels/triton/store_kv.py) in Triton's interpreter against the torch
twin `ref_store_kv`: bit for bit (codes and bf16 scales) for bf16, fp8 and int8 pages, rotated and
smoothed, head sizes 64 and 128, over a pool past 2**31 elements; slot -1 writes nothing; NaN,
inf and outlier rows quantize as the twin does. Tolerance: none (exact equality)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.store_kv import ref_store_kv
from kernels.triton import launch
from tests.kernels.triton_pools import draw_pages, lazy_zeros, pool_pages

PAGE = 16
KV_HEADS = 1


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


CASES = [  # (page dtype, head size, rotated, smoothed)
    (torch.bfloat16, 64, False, False),
    (torch.uint8, 128, True, False),
    (torch.uint8, 64, True, True),
    (torch.int8, 128, True, True),
    (torch.int8, 64, False, False),
]


@pytest.mark.parametrize(("storage", "dim", "rotated", "smoothed"), CASES)
def test_store_is_bit_for_bit_the_torch_twin_and_slot_minus_one_writes_nothing(
        storage, dim, rotated, smoothed):
    gen = torch.Generator().manual_seed(dim)
    quant = storage in (torch.uint8, torch.int8)
    num_pages = pool_pages(KV_HEADS, PAGE, dim)
    tokens = 48
    pages = draw_pages(num_pages, 3, gen)
    slots = (pages.repeat_interleave(PAGE) * PAGE + torch.arange(3 * PAGE) % PAGE)[:tokens]
    slots = slots[torch.randperm(tokens, generator=gen)]
    slots[[1, 17, 40]] = -1  # padding rows
    slots, pages = slots.to(DEVICE), pages.to(DEVICE)
    magnitude = torch.logspace(-4, 3, tokens)[:, None, None]  # tiny to outlier rows
    k = (torch.randn(tokens, KV_HEADS, dim, generator=gen) * magnitude).bfloat16()
    v = (torch.randn(tokens, KV_HEADS, dim, generator=gen) * magnitude).bfloat16()
    if quant:
        k[5, 0, 3], k[6, 0, 9], v[7, 0, 0] = float("nan"), float("inf"), float("-inf")
    smooth = (None, None, None)
    if smoothed:
        smooth = tuple(t.to(DEVICE) for t in (torch.randn(KV_HEADS, dim, generator=gen),
                                              torch.rand(KV_HEADS, dim, generator=gen) + 0.5,
                                              torch.rand(KV_HEADS, dim, generator=gen) + 0.5))
    # non-contiguous inputs, as slices of a fused projection are
    k, v = k.to(DEVICE), v.to(DEVICE)
    k = torch.cat([k, torch.zeros_like(k)], dim=-1)[..., :dim]
    results = []
    for store in ("ref", "triton"):
        shape = (KV_HEADS, num_pages, PAGE, dim)
        kc, vc = lazy_zeros(shape, storage), lazy_zeros(shape, storage)
        ks = lazy_zeros(shape[:3], torch.bfloat16) if quant else None
        vs = lazy_zeros(shape[:3], torch.bfloat16) if quant else None
        for t in (kc, vc, ks, vs):  # poison the pages the rows go to (and their neighbours)
            if t is not None:
                _bits(t)[:, pages] = 0x5A
        if store == "ref":
            keep = slots >= 0
            ref_store_kv(k[keep], v[keep], kc, vc, slots[keep], ks, vs, rotated, *smooth)
        else:
            launch.store_kv(k, v, kc, vc, slots, ks, vs, rotated, *smooth)
        results.append([_bits(t)[:, pages] for t in (kc, vc, ks, vs) if t is not None])
        # nothing outside the three pages was written
        assert all(int(_bits(t).view(-1)[:4096].sum()) == 0 for t in (kc, vc, ks, vs)
                   if t is not None and int(pages.min()) * PAGE * dim > 4096)
    for want, got in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_store_refuses_quantized_pages_without_scales():
    kc = torch.zeros(1, 4, PAGE, 64, dtype=torch.int8, device=DEVICE)
    x = torch.randn(2, 1, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="need k_scale and v_scale"):
        launch.store_kv(x, x, kc, kc.clone(), torch.tensor([0, 1], device=DEVICE))
