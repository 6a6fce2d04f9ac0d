"""The kernels behind batch invariance (docs/DESIGN.md): a row's output bits do not depend on
the other rows of its call. The int8-activation block linears at any row count, and prefill
attention however the prompt is cut into chunks, equal to the decode kernel at each position."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import paged_decode_attention, paged_prefill_attention, store_kv
from kernels.cpu_ops import native
from kernels.qgemv import pack_q4_blocks
from kernels.qgemv_i8 import int8_kernels_available, q4_linear_i8, q8_linear_i8
from tests.kernels.test_kv_formats import DIM, HEADS, KV_HEADS, PAGE, _pages

needs_native = pytest.mark.skipif(native() is None, reason="the C++ CPU ops are not built")
ROW_COUNTS = (1, 2, 3, 5, 16, 17, 33, 128, 300)


@pytest.mark.skipif(not int8_kernels_available(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("kind", ("q4", "q8"))
@pytest.mark.parametrize("limbs", (1, 2))
def test_int8_block_rows_have_the_same_bits_at_every_row_count(kind: str, limbs: int) -> None:
    gen = torch.Generator().manual_seed(7)
    n, k = 70, 576
    d = (torch.randn(n, k // 32, generator=gen) * 0.02).half()
    m = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen) * 3

    def run(rows: torch.Tensor) -> torch.Tensor:
        if kind == "q4":
            return q4_linear_i8(rows, pack_q4_blocks(codes), d, m, limbs=limbs)
        return q8_linear_i8(rows, q8, d, limbs=limbs)

    everything = run(x)
    for rows in ROW_COUNTS:
        assert torch.equal(run(x[:rows]), everything[:rows]), rows
    for i in (0, 41, max(ROW_COUNTS) - 1):
        assert torch.equal(run(x[i : i + 1]), everything[i : i + 1]), i


def _causal_mask(start: int, end: int) -> torch.Tensor:
    # as runtime/attention/backend.py builds it: row i sees keys 0..start + i
    return torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)


@needs_native
@pytest.mark.parametrize("fmt", ("fp32", "bf16", "fp8", "int8"))
def test_prefill_rows_are_the_decode_rows_however_the_prompt_is_chunked(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    length = 53
    k_cache, v_cache, k_scale, v_scale = _pages(5, fmt)
    page_ids = torch.tensor([3, 0, 4, 1])
    slots = page_ids.repeat_interleave(PAGE)[:length] * PAGE + torch.arange(length) % PAGE
    k = torch.randn(length, KV_HEADS, DIM, generator=gen) * 2
    v = torch.randn(length, KV_HEADS, DIM, generator=gen)
    hadamard = fmt in ("fp8", "int8")
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale, hadamard)
    q = torch.randn(length, HEADS, DIM, generator=gen)
    pages = (k_cache, v_cache)
    scales = (k_scale, v_scale, hadamard)
    whole = paged_prefill_attention(q, *pages, page_ids, length, None, 0.125, *scales)
    cuts = (0, 7, 16, 40, length)
    chunked = torch.cat([paged_prefill_attention(q[a:b], *pages, page_ids, b,
                                                 _causal_mask(a, b) if a else None, 0.125,
                                                 *scales)
                         for a, b in itertools.pairwise(cuts)])
    assert torch.equal(chunked, whole)
    for pos in (0, 15, 16, length - 1):
        decode = paged_decode_attention(q[pos : pos + 1], *pages, page_ids.unsqueeze(0),
                                        torch.tensor([pos + 1]), 0.125, *scales)
        assert torch.equal(decode, whole[pos : pos + 1]), pos
