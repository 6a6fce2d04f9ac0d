"""The bf16 block ops (kernels/cpu/qgemv.cpp gemm_bf16) against their twins: bf16(x) @ bf16(W)^T."""

from __future__ import annotations

import pytest
import torch

from kernels.qgemm_bf16 import (
    bf16_gemm_available,
    bf16_linear,
    q4_linear_bf16,
    q8_linear_bf16,
    ref_bf16_linear,
    ref_q4_linear_bf16,
    ref_q8_linear_bf16,
)
from kernels.qgemv import pack_q4_blocks, ref_q4_linear

pytestmark = pytest.mark.skipif(not bf16_gemm_available(),
                                reason="no C++ toolchain or no bf16 GEMM in torch's BLAS")

ROWS = (1, 3, 16, 17, 40)
SHAPES = ((1, 32), (7, 160), (129, 576), (300, 1536))  # (N, K); 300 rows span two tiles
# Both sides multiply the same bf16 values; only float32 vs float64 summation order differs.
REL_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Micro-sized matmuls: one thread is faster and quieter on a shared box."""


def _close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    bound = (x.abs() @ w.abs().t()) * REL_TOL + 1e-6
    return bool(((y - ref).abs() <= bound).all())


@pytest.mark.parametrize("offsets", ["m", "zeros", "sym"])
def test_q4_linear_bf16_equals_its_twin_over_sizes_and_row_counts(offsets):
    gen = torch.Generator().manual_seed(11)
    for n, k in SHAPES:
        for group in sorted({32, 128 if k >= 128 else 32}):
            groups = -(-k // group)
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            d = (torch.randn(n, groups, generator=gen) * 0.02).half()
            m = (torch.randn(n, groups, generator=gen) * 0.1).half() if offsets == "m" else None
            zeros = (torch.randint(0, 256, (-(-n * groups // 2),), dtype=torch.uint8,
                                   generator=gen) if offsets == "zeros" else None)
            qs = pack_q4_blocks(codes)
            dense = ref_q4_linear(torch.eye(k), qs, d, m, group, zeros).t()  # [n, k]
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                y = q4_linear_bf16(x, qs, d, m, group, zeros)
                ref = ref_q4_linear_bf16(x, qs, d, m, group, zeros)
                assert y.shape == (rows, n) and not y.isnan().any(), (n, k, group, rows)
                assert _close(y, ref, x, dense), (n, k, group, rows)


def test_q8_linear_bf16_equals_its_twin():
    gen = torch.Generator().manual_seed(12)
    for n, k in SHAPES:
        qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        for rows in ROWS:
            x = torch.randn(2, rows, k, generator=gen)  # leading dimensions are kept
            y = q8_linear_bf16(x, qs, d)
            ref = ref_q8_linear_bf16(x.reshape(-1, k), qs, d).view(2, rows, n)
            assert y.shape == (2, rows, n)
            bound = x.abs() @ (qs.float().abs() * d.float().repeat_interleave(32, 1)).t()
            assert ((y - ref).abs() <= bound * REL_TOL + 1e-6).all(), (n, k, rows)


def test_bf16_rounding_is_what_the_op_computes_not_float32():
    # The op is meant to round: a float32 result would differ from the twin by bf16's error.
    gen = torch.Generator().manual_seed(13)
    codes = torch.randint(0, 16, (64, 576), dtype=torch.uint8, generator=gen)
    d = (torch.rand(64, 18, generator=gen) * 0.02 + 0.001).half()
    m = (torch.randn(64, 18, generator=gen) * 0.1).half()
    qs = pack_q4_blocks(codes)
    x = torch.randn(33, 576, generator=gen)
    y = q4_linear_bf16(x, qs, d, m, 32)
    exact = ref_q4_linear(x, qs, d, m, 32)
    rounded = ref_q4_linear_bf16(x, qs, d, m, 32)
    assert (y - rounded).abs().max() < 0.05 * (exact - rounded).abs().max()


def test_bad_shapes_raise():
    qs = pack_q4_blocks(torch.zeros(4, 64, dtype=torch.uint8))
    d = torch.ones(4, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="columns"):
        q4_linear_bf16(torch.randn(20, 32), qs, d, None, 32)
    with pytest.raises(RuntimeError, match="scales"):
        q4_linear_bf16(torch.randn(20, 64), qs, torch.ones(3, 2, dtype=torch.float16), None, 32)


def test_bf16_linear_over_a_dequantized_copy_equals_its_twin_and_the_tile_op():
    gen = torch.Generator().manual_seed(14)
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        d = (torch.randn(n, k // 32, generator=gen) * 0.02).half()
        m = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
        qs = pack_q4_blocks(codes)
        w = ref_q4_linear(torch.eye(k), qs, d, m, 32).t().contiguous()  # [n, k] float32
        wb = w.to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            y = bf16_linear(x, wb)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert _close(y, ref_bf16_linear(x, wb), x, w), (n, k, rows)
            assert _close(y, q4_linear_bf16(x, qs, d, m, 32), x, w), (n, k, rows)
