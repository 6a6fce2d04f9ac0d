"""Rotated FP8 and INT8 KV under a prefix-cache hit, op by op: the cached pages are written
once by a whole prefill, and the uncached tail of the same prompt is then stored and attended
the way the engine does it (a masked prefill chunk, or the decode op when one token remains), on the
C++ ops and on their torch twins. Given the same K/V inputs, the tail's outputs are the whole
prefill's rows (the rotation is the same on every path); what an engine-level prefix hit adds
is only the re-quantization of the tail's K/V, which `test_scale_tie_*` shows is discontinuous.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_ops import native
from kernels.fp8 import quantize_fp8_kv
from kernels.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
)
from kernels.store_kv import ref_store_kv, store_kv

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
CACHED = 48  # three whole pages, as the prefix cache keeps them


def _paths(use_native: bool):
    if use_native:
        if native() is None:
            pytest.skip("no C++ toolchain: the torch twins are the only path here")
        return store_kv, paged_prefill_attention, paged_decode_attention
    return ref_store_kv, ref_paged_prefill_attention, ref_paged_decode_attention


def _case(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    k[:, :, 27] *= 9.0  # a large low-frequency RoPE channel, as the real model's keys have
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    return q, k, v


PAGE_DTYPES = {"fp8": torch.uint8, "int8": torch.int8}


def _empty_pages(num_pages: int, fmt: str = "fp8"):
    shape = (KV_HEADS, num_pages, PAGE, DIM)
    kc = torch.full(shape, 0x7E, dtype=PAGE_DTYPES[fmt])  # poisoned: garbage codes, never read
    ks = torch.full(shape[:-1], 3.0, dtype=torch.bfloat16)
    return kc, kc.clone(), ks, ks.clone()


def _slots(page_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return page_ids[pos // PAGE] * PAGE + pos % PAGE


@pytest.mark.parametrize("fmt", sorted(PAGE_DTYPES))
@pytest.mark.parametrize("use_native", [True, False], ids=["cpp", "twin"])
@pytest.mark.parametrize("hadamard", [True, False], ids=["rotated", "plain"])
@pytest.mark.parametrize("remaining", [1, 2, 5])
def test_prefix_hit_tail_reads_what_a_whole_prefill_reads(fmt, use_native, hadamard, remaining):
    store, prefill, decode = _paths(use_native)
    tokens = CACHED + remaining
    q, k, v = _case(tokens, seed=remaining)
    scale = DIM**-0.5
    # whole prefill: every token stored in one call, then causal attention over all of them
    page_ids = torch.tensor([4, 1, 6, 2])  # out of order, as the pool hands pages out
    kc, vc, ks, vs = _empty_pages(8, fmt)
    store(k, v, kc, vc, _slots(page_ids, 0, tokens), ks, vs, hadamard)
    whole = prefill(q, kc, vc, page_ids, tokens, None, scale, ks, vs, hadamard)
    # prefix hit: the cached pages as that prefill left them, the tail stored in a fresh page
    hit_ids = torch.tensor([4, 1, 6, 7])
    kc2, vc2, ks2, vs2 = kc.clone(), vc.clone(), ks.clone(), vs.clone()
    store(k[CACHED:], v[CACHED:], kc2, vc2, _slots(hit_ids, CACHED, tokens), ks2, vs2, hadamard)
    assert torch.equal(kc2[:, 7, :remaining], kc[:, 2, :remaining])  # same bytes, new page
    assert torch.equal(ks2[:, 7, :remaining], ks[:, 2, :remaining])
    if remaining == 1:  # a one-token chunk runs as a decode step (model_runner)
        tail = decode(q[CACHED:], kc2, vc2, hit_ids[None], torch.tensor([tokens]), scale,
                      ks2, vs2, hadamard)
    else:
        q_pos = torch.arange(CACHED, tokens).unsqueeze(1)
        mask = torch.arange(tokens).unsqueeze(0) <= q_pos
        tail = prefill(q[CACHED:], kc2, vc2, hit_ids, tokens, mask, scale, ks2, vs2, hadamard)
    torch.testing.assert_close(tail, whole[CACHED:], atol=1e-5, rtol=1e-5)


def _smoothing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A key shift, key channel scale and value channel scale, [kv_heads, dim] each."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(KV_HEADS, DIM, generator=gen) * 3,
            torch.rand(KV_HEADS, DIM, generator=gen) * 2 + 0.3,
            torch.rand(KV_HEADS, DIM, generator=gen) * 2 + 0.3)


@pytest.mark.parametrize("fmt", sorted(PAGE_DTYPES))
@pytest.mark.parametrize("smoothed", [True, False], ids=["smoothed", "unsmoothed"])
@pytest.mark.parametrize("hadamard", [True, False], ids=["rotated", "plain"])
def test_cpp_and_twin_store_the_same_bytes_and_read_the_same_attention(fmt, hadamard, smoothed):
    if native() is None:
        pytest.skip("no C++ toolchain: nothing to compare the twins with")
    tokens = CACHED + 3
    q, k, v = _case(tokens, seed=7)
    shift, k_div, v_div = _smoothing(3) if smoothed else (None, None, None)
    page_ids = torch.tensor([4, 1, 6, 2])
    caches = []
    for store in (store_kv, ref_store_kv):
        kc, vc, ks, vs = _empty_pages(8, fmt)
        store(k, v, kc, vc, _slots(page_ids, 0, tokens), ks, vs, hadamard, shift, k_div, v_div)
        caches.append((kc, vc, ks, vs))
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
    kc, vc, ks, vs = caches[0]
    lens = torch.tensor([tokens])
    got = paged_decode_attention(q[-1:], kc, vc, page_ids[None], lens, DIM**-0.5, ks, vs,
                                 hadamard, k_div, v_div)
    want = ref_paged_decode_attention(q[-1:], kc, vc, page_ids[None], lens, DIM**-0.5, ks, vs,
                                      hadamard, k_div, v_div)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    whole = paged_prefill_attention(q, kc, vc, page_ids, tokens, None, DIM**-0.5, ks, vs,
                                    hadamard, k_div, v_div)
    torch.testing.assert_close(whole[-1:], got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", sorted(PAGE_DTYPES))
def test_smoothed_quantized_attention_is_attention_over_the_original_keys_and_values(fmt):
    """(k - shift) / s read by q * s, v / t read back times t: the float32 answer up to e4m3
    or int8
    (a missing factor anywhere gives a relative error near 1); the keys' mean as the shift
    halves the error on keys with a constant part."""
    tokens = CACHED + 3
    q, k, v = _case(tokens, seed=11)
    k = k + torch.randn(DIM, generator=torch.Generator().manual_seed(2)) * 6
    page_ids = torch.tensor([4, 1, 6, 2])
    exact_pages = [torch.zeros(KV_HEADS, 8, PAGE, DIM) for _ in range(2)]
    ref_store_kv(k, v, *exact_pages, _slots(page_ids, 0, tokens))
    exact = ref_paged_prefill_attention(q, *exact_pages, page_ids, tokens, None, DIM**-0.5)

    def error(shift, k_div, v_div) -> float:
        kc, vc, ks, vs = _empty_pages(8, fmt)
        store_kv(k, v, kc, vc, _slots(page_ids, 0, tokens), ks, vs, True, shift, k_div, v_div)
        got = paged_prefill_attention(q, kc, vc, page_ids, tokens, None, DIM**-0.5, ks, vs,
                                      True, k_div, v_div)
        return float((got - exact).norm() / exact.norm())

    _, k_div, v_div = _smoothing(5)
    unsmoothed = error(None, None, None)
    assert error(k.mean(0), None, None) < 0.5 * unsmoothed
    assert error(k.mean(0), k_div, v_div) < 0.1


def test_scale_tie_makes_requantization_discontinuous():
    """Why an engine-level prefix hit is compared within a KL bound, not 1e-4: the tail's K/V
    come from GEMMs over fewer rows, which round differently (~1e-6), and a per-row bf16 scale
    whose amax / 448 sits at a bf16 rounding midpoint flips to the next bf16 value, and the
    row's elements near a rounding boundary move by a whole e4m3 step (seen in the real model:
    layer 6, one head, one token, three elements; plain FP8 does it on other prompts)."""
    mid = (221.5 / 128) * 2.0**-7  # halfway between the bf16 values 221/128 and 222/128 * 2^-7
    amax = torch.tensor(mid * 448.0, dtype=torch.float32)
    for _ in range(8):  # step down to the last float whose scale still rounds down
        amax = torch.nextafter(amax, torch.tensor(0.0))
    row = torch.linspace(-3.0, 3.0, DIM).view(1, 1, DIM)
    scales, codes = [], []
    for _ in range(16):  # 16 consecutive floats (one ulp apart) across the midpoint
        row[0, 0, 0] = amax
        q, s = quantize_fp8_kv(row)
        scales.append(s.item())
        codes.append(q.view(torch.uint8).clone())
        amax = torch.nextafter(amax, torch.tensor(10.0))
    flips = [i for i in range(15) if scales[i] != scales[i + 1]]
    assert len(flips) == 1, scales
    i = flips[0]
    # elements near a rounding boundary move by a whole e4m3 step (up to 1/8 of their value)
    assert (codes[i] != codes[i + 1]).any()
