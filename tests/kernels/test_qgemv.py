"""The Q4/Q8 block linear kernels (kernels/cpu/qgemv.cpp) against their torch twins: sizes
swept (powers of two and odd), every scale dtype and offset form, a short last group, random
inputs, poisoned outputs."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.cpu_ops import native
from kernels.qgemv import (
    pack_q4_blocks,
    q4_dequantize,
    q4_linear,
    q8_dequantize,
    q8_linear,
    ref_q4_dequantize,
    ref_q4_linear,
    ref_q8_dequantize,
    ref_q8_linear,
    unpack_q4_blocks,
)

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ toolchain: the twins run alone")

ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 97)  # every tile shape and remainder; past 16 rows
# the op multiplies dequantized tiles of W by BLAS instead
SHAPES = ((1, 32), (3, 96), (7, 160), (64, 64), (129, 576), (200, 1536))  # (N, K)
# fp32 sums of K products in another order: |error| <= K * eps * sum |x w| (a loose bound).
REL_TOL = 2e-5
POISON = float("nan")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Micro-sized matmuls: one thread is faster and quieter on a shared box."""


def close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    bound = (x.abs() @ w.abs().t()) * REL_TOL + 1e-6
    return bool(((y - ref).abs() <= bound).all())


def q4_weights(n: int, k: int, group: int, dtype: torch.dtype, offsets: str,
               gen: torch.Generator) -> dict:
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.randn(n, groups, generator=gen) * 0.02).to(dtype)
    m = (torch.randn(n, groups, generator=gen) * 0.1).to(dtype) if offsets == "m" else None
    zeros = None
    if offsets == "zeros":
        zeros = torch.randint(0, 256, (-(-n * groups // 2),), dtype=torch.uint8, generator=gen)
    return {"qs": pack_q4_blocks(codes), "d": d, "m": m, "zeros": zeros, "codes": codes}


def test_block_packing_round_trips_and_follows_the_gguf_nibble_order():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    qs = pack_q4_blocks(codes)
    assert qs.shape == (5, 32) and torch.equal(unpack_q4_blocks(qs), codes)
    # byte j of a block: weight j in the low nibble, weight j + 16 in the high one
    assert int(qs[2, 16 + 3]) == int(codes[2, 32 + 3]) | int(codes[2, 32 + 19]) << 4


@pytest.mark.parametrize("offsets", ["m", "zeros", "sym"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["f16", "bf16", "f32"])
def test_q4_linear_equals_its_twin_over_sizes_groups_and_row_counts(dtype, offsets):
    gen = torch.Generator().manual_seed(hash((str(dtype), offsets)) % 2**31)
    for (n, k), group in itertools.product(SHAPES, (32, 64, 128)):
        w = q4_weights(n, k, group, dtype, offsets, gen)
        args = (w["qs"], w["d"], w["m"], group)
        dense = ref_q4_dequantize(*args, zeros=w["zeros"])
        # fp32 scales: fma(q, d, m) may round d * q + m differently (16-bit ones: exact)
        assert torch.allclose(q4_dequantize(*args, zeros=w["zeros"]), dense, rtol=1e-6,
                              atol=1e-7)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            out = torch.full((rows, n), POISON)
            y = q4_linear(x, *args, zeros=w["zeros"], out=out)
            ref = ref_q4_linear(x, *args, zeros=w["zeros"])
            assert y.data_ptr() == out.data_ptr() and not y.isnan().any(), (n, k, group, rows)
            assert close(y, ref, x, dense), (n, k, group, rows)


def test_q4_dequantize_is_bit_exact_for_16_bit_scales_with_a_short_last_group():
    gen = torch.Generator().manual_seed(1)
    for dtype, offsets in itertools.product((torch.float16, torch.bfloat16),
                                            ("m", "zeros", "sym")):
        w = q4_weights(9, 576, 128, dtype, offsets, gen)  # 576 = 4.5 groups of 128
        args = (w["qs"], w["d"], w["m"], 128)
        assert torch.equal(q4_dequantize(*args, zeros=w["zeros"]),
                           ref_q4_dequantize(*args, zeros=w["zeros"]))


def test_q4_short_last_group_reads_its_own_scale():
    k, group = 576, 128
    codes = torch.full((4, k), 9, dtype=torch.uint8)  # q - 8 = 1 everywhere
    d = torch.tensor([[1.0, 1.0, 1.0, 1.0, 100.0]] * 4, dtype=torch.bfloat16)
    x = torch.ones(1, k)
    y = q4_linear(x, pack_q4_blocks(codes), d, None, group)
    assert torch.equal(y, torch.full((1, 4), 512.0 + 64 * 100.0))


def test_q8_linear_equals_its_twin_over_sizes_and_row_counts():
    gen = torch.Generator().manual_seed(2)
    for n, k in SHAPES:
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        dense = ref_q8_dequantize(qs, d)
        assert torch.equal(q8_dequantize(qs, d), dense)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            out = torch.full((rows, n), POISON)
            y = q8_linear(x, qs, d, out=out)
            assert not y.isnan().any() and close(y, ref_q8_linear(x, qs, d), x, dense)


def test_kernels_keep_leading_dimensions_and_use_every_thread_the_same_way():
    gen = torch.Generator().manual_seed(3)
    w = q4_weights(300, 576, 64, torch.float16, "m", gen)
    for lead in ((2, 3), (5, 8)):  # register tiles; dequantized tiles (300 rows: two of them)
        x = torch.randn(*lead, 576, generator=gen)
        y1 = q4_linear(x, w["qs"], w["d"], w["m"], 64)
        assert y1.shape == (*lead, 300)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            y2 = q4_linear(x, w["qs"], w["d"], w["m"], 64)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(y1, y2)  # a row's sum never depends on how rows are split


@pytest.mark.parametrize("bad", ["k_not_32", "scale_shape", "x_width", "x_dtype", "out_shape"])
def test_bad_shapes_and_dtypes_raise_instead_of_reading_out_of_bounds(bad):
    qs = torch.zeros(8, 48, dtype=torch.uint8)  # K = 96
    d = torch.ones(8, 3, dtype=torch.float16)
    x = torch.randn(2, 96)
    kwargs: dict = {}
    if bad == "k_not_32":
        qs = torch.zeros(8, 40, dtype=torch.uint8)
    elif bad == "scale_shape":
        d = torch.ones(8, 2, dtype=torch.float16)
    elif bad == "x_width":
        x = torch.randn(2, 64)
    elif bad == "x_dtype":
        x = x.double()
    else:
        kwargs["out"] = torch.empty(2, 9)
    with pytest.raises(RuntimeError):
        q4_linear(x, qs, d, None, 32, **kwargs)
