"""The Triton paged attention kernels (kernels/triton/) in Triton's interpreter against the torch
twins (kernels/paged_attention.py): decode and chunked prefill in one varlen launch, bf16, fp16,
fp8 and int8 pages (rotated, and smoothed), GQA 1/4/8, head sizes 64 and 128, random
non-contiguous tables over pools whose offsets pass 2**31 elements, ragged lengths across page
and split boundaries, outputs poisoned with NaN before each launch.

Tolerance, every format: |got - ref| <= 2e-2 + 1e-2 |ref| against the fp32 twin reading the same
codes and scales (vLLM's bf16 test: 1.5e-2 / 1e-2; the interpreter also truncates fp32 -> bf16
casts). Split-K: 1 and 16 splits agree within 2e-3 (fp32 outputs), relative to the output's
largest magnitude where that exceeds 1 (V is scaled by 2 here).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.paged_attention import ref_paged_decode_attention, ref_paged_prefill_attention
from kernels.store_kv import ref_store_kv
from kernels.triton import launch
from tests.kernels.triton_pools import draw_pages, lazy_zeros, pool_pages

PAGE = 16
KV_HEADS = 2
ATOL, RTOL = 2e-2, 1e-2
SPLIT_ATOL = 2e-3
STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8,
           "int8": torch.int8}


class Pool:
    """One layer's K/V pages holding `lens` tokens per sequence, written by the torch store."""

    def __init__(self, fmt: str, dim: int, lens: list[int], gen: torch.Generator,
                 smooth: bool = False) -> None:
        storage = STORAGE[fmt]
        self.quant = fmt in ("fp8", "int8")
        self.num_pages = pool_pages(KV_HEADS, PAGE, dim)
        shape = (KV_HEADS, self.num_pages, PAGE, dim)
        self.k, self.v = lazy_zeros(shape, storage), lazy_zeros(shape, storage)
        self.k_scale = self.v_scale = None
        if self.quant:
            self.k_scale = lazy_zeros(shape[:3], torch.bfloat16)
            self.v_scale = lazy_zeros(shape[:3], torch.bfloat16)
        self.smoothing = (None, None, None)
        if smooth:
            self.smoothing = tuple(t.to(DEVICE) for t in (
                torch.randn(KV_HEADS, dim, generator=gen),
                torch.rand(KV_HEADS, dim, generator=gen) + 0.5,
                torch.rand(KV_HEADS, dim, generator=gen) + 0.5))
        max_pages = -(-max(lens) // PAGE) + 1  # a stale extra column the kernel must not read
        pages = draw_pages(self.num_pages, len(lens) * max_pages, gen)
        table = pages.view(len(lens), max_pages)
        self.table, self.lens = table.to(DEVICE), torch.tensor(lens, device=DEVICE)
        slots = torch.cat([table[s, :].repeat_interleave(PAGE)[:n] * PAGE
                           + torch.arange(n) % PAGE for s, n in enumerate(lens)])
        tokens = slots.numel()
        # 1-byte scales are amax / 448 or / 127, far from 1: a dropped descale cannot pass
        k = torch.randn(tokens, KV_HEADS, dim, generator=gen)
        v = torch.randn(tokens, KV_HEADS, dim, generator=gen) * 2
        if not self.quant:
            k, v = k.to(storage), v.to(storage)
        k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
        ref_store_kv(k, v, self.k, self.v, slots, self.k_scale, self.v_scale, self.quant,
                     *self.smoothing)
        q_scale = self.smoothing[1]
        self.q_scale, self.out_scale = q_scale, self.smoothing[2]

    def args(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale, hadamard=self.quant,
                    q_scale=self.q_scale, out_scale=self.out_scale)


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL, rtol: float = RTOL):
    assert not got.isnan().any(), "a row was never written (poisoned NaN left)"
    err = (got.float() - want).abs()
    bound = atol + rtol * want.abs()
    assert bool((err <= bound).all()), f"max |err| {err.max():.3g}, worst excess " \
        f"{(err - bound).max():.3g}"


def _poisoned(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, width), float("nan"), dtype=dtype, device=DEVICE)


def _workspace(tokens: int, heads: int, splits: int, dim: int):
    return (torch.full((tokens, heads, splits, dim), float("nan"), device=DEVICE),
            torch.full((tokens, heads, splits), float("nan"), device=DEVICE))


DECODE_CASES = [  # (format, head size, query heads per KV head)
    ("bf16", 64, 1),
    ("fp16", 128, 4),
    ("fp8", 128, 8),
    ("fp8", 64, 1),
    ("int8", 64, 4),
    ("int8", 128, 8),
]


@pytest.mark.parametrize(("fmt", "dim", "group"), DECODE_CASES)
def test_decode_matches_the_torch_twin_with_1_and_16_splits(fmt, dim, group):
    gen = torch.Generator().manual_seed(dim * 10 + group)
    # lengths: one token, a page exactly, across pages, splits of ragged length, empty splits
    lens = [1, 16, 47, 161]
    pool = Pool(fmt, dim, lens, gen)
    heads = KV_HEADS * group
    q = torch.randn(len(lens), heads, dim, generator=gen).to(
        device=DEVICE, dtype=torch.float16 if fmt == "fp16" else torch.bfloat16)
    scale = dim**-0.5
    want = ref_paged_decode_attention(q.float(), pool.k, pool.v, pool.table, pool.lens, scale,
                                      **pool.args())
    outs = {}
    for splits in (1, 16):
        out = _poisoned(len(lens), heads * dim, torch.float32)
        launch.paged_attention(q, pool.k, pool.v, pool.table, pool.lens,
                               torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE),
                               scale,
                               **pool.args(), num_splits=splits, out=out,
                               out_dtype=torch.float32,
                               workspace=_workspace(len(lens), heads, splits, dim)
                               if splits > 1 else None)
        assert_close(out, want)
        outs[splits] = out
    assert (outs[1] - outs[16]).abs().max() <= SPLIT_ATOL * want.abs().max().clamp(min=1)
    if pool.quant:  # the test would catch a kernel that dropped a descale
        unscaled = ref_paged_decode_attention(q.float(), pool.k, pool.v, pool.table, pool.lens,
                                              scale, torch.ones_like(pool.k_scale),
                                              pool.v_scale, hadamard=True)
        assert (unscaled - want).abs().max() > 20 * ATOL
        unscaled = ref_paged_decode_attention(q.float(), pool.k, pool.v, pool.table, pool.lens,
                                              scale, pool.k_scale,
                                              torch.ones_like(pool.v_scale), hadamard=True)
        assert (unscaled - want).abs().max() > 20 * ATOL


PREFILL_CASES = [("bf16", 128, 4), ("fp8", 64, 8), ("int8", 128, 1)]


@pytest.mark.parametrize(("fmt", "dim", "group"), PREFILL_CASES)
def test_varlen_prefill_chunks_and_decodes_in_one_launch_match_the_twins(fmt, dim, group):
    gen = torch.Generator().manual_seed(dim + group)
    # (cached prefix, new tokens): decode rows, a whole prompt, chunks extending a paged prefix
    shape = [(40, 1), (0, 37), (33, 18), (16, 16), (5, 1)]
    lens = [p + n for p, n in shape]
    pool = Pool(fmt, dim, lens, gen)
    heads = KV_HEADS * group
    q_lens = [n for _, n in shape]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = dim**-0.5
    out = _poisoned(q.shape[0], heads * dim, q.dtype)
    launch.paged_attention(q, pool.k, pool.v, pool.table, pool.lens, cu.to(DEVICE), scale,
                           **pool.args(), out=out)
    for s, (prefix, n) in enumerate(shape):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        ctx = prefix + n
        pages = pool.table[s, : -(-ctx // PAGE)]
        mask = (torch.arange(ctx)[None] <= torch.arange(prefix, ctx)[:, None]).to(DEVICE)
        want = ref_paged_prefill_attention(q[rows].float(), pool.k, pool.v, pages, ctx,
                                           mask if prefix else None, scale, **pool.args())
        assert_close(out[rows], want)
        single = launch.paged_prefill_attention(q[rows], pool.k, pool.v, pages, ctx,
                                                mask if prefix else None, scale, **pool.args())
        assert_close(single, want)


def test_smoothed_int8_decode_applies_query_and_output_scales_as_the_twin():
    gen = torch.Generator().manual_seed(7)
    lens = [3, 70, 129]
    pool = Pool("int8", 64, lens, gen, smooth=True)
    q = torch.randn(len(lens), KV_HEADS * 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    want = ref_paged_decode_attention(q.float(), pool.k, pool.v, pool.table, pool.lens, 0.125,
                                      **pool.args())
    for splits in (1, 16):
        got = launch.paged_decode_attention(q, pool.k, pool.v, pool.table, pool.lens, 0.125,
                                            **pool.args(), num_splits=splits)
        assert_close(got, want)


def test_invalid_sequence_reads_no_kv_and_leaves_the_others_bitwise_unchanged():
    gen = torch.Generator().manual_seed(3)
    lens = [20, 50, 9]
    pool = Pool("fp8", 64, lens, gen)
    q = torch.randn(len(lens), KV_HEADS * 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    base = launch.paged_decode_attention(q, pool.k, pool.v, pool.table, pool.lens, 0.125,
                                         **pool.args(), num_splits=4)
    valid = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    # a failed sequence may name pages it does not own: point its table past the pool
    table = pool.table.clone()
    table[1] = 2**40
    got = launch.paged_decode_attention(q, pool.k, pool.v, table, pool.lens, 0.125,
                                        **pool.args(), num_splits=4, seq_valid=valid)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[2])


def test_padded_rows_of_length_zero_output_zeros_not_nan():
    gen = torch.Generator().manual_seed(5)
    pool = Pool("bf16", 64, [30, 1], gen)
    q = torch.randn(2, KV_HEADS, 64, generator=gen).to(DEVICE, torch.bfloat16)
    lens = torch.tensor([30, 0], device=DEVICE)  # a CUDA-graph padding row
    for splits in (1, 16):
        got = launch.paged_decode_attention(q, pool.k, pool.v, pool.table, lens, 0.125,
                                            num_splits=splits)
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_split_count_policy_depends_on_the_batch_bucket_only():
    assert launch.decode_num_splits(1, 8, 132) == 16
    assert launch.decode_num_splits(64, 8, 132) == 2
    assert launch.decode_num_splits(256, 8, 132) == 1
    assert all(launch.decode_num_splits(b, 8, 132) in (1, 2, 4, 8, 16) for b in range(1, 300))


def test_launcher_refuses_one_byte_pages_without_their_scales():
    gen = torch.Generator().manual_seed(1)
    pool = Pool("int8", 64, [5], gen)
    q = torch.randn(1, KV_HEADS, 64, generator=gen).to(DEVICE, torch.bfloat16)
    with pytest.raises(AssertionError, match="need k_scale and v_scale"):
        launch.paged_decode_attention(q, pool.k, pool.v, pool.table, pool.lens, 0.125)

