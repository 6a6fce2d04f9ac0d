"""The bf16 op over a bf16 copy of block weights (kernels/cpu/qgemv.cpp bf16_linear_out) against
its twin: bf16(x) @ W^T, float32 sums."""

from __future__ import annotations

import pytest
import torch

from kernels.qgemm_bf16 import bf16_gemm_available, bf16_linear, ref_bf16_linear
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


def _weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A dequantized Q4 block weight [n, k] float32, as BlockLinear's bf16 copy is made from."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.randn(n, k // 32, generator=gen) * 0.02).half()
    m = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
    return ref_q4_linear(torch.eye(k), pack_q4_blocks(codes), d, m, 32).t().contiguous()


def test_bf16_rounding_is_what_the_op_computes_not_float32():
    # The op is meant to round: a float32 result would differ from the twin by bf16's error.
    gen = torch.Generator().manual_seed(13)
    w = _weight(64, 576, gen)
    x = torch.randn(33, 576, generator=gen)
    y = bf16_linear(x, w.bfloat16())
    exact = x @ w.t()
    rounded = ref_bf16_linear(x, w.bfloat16())
    assert (y - rounded).abs().max() < 0.05 * (exact - rounded).abs().max()


def test_bad_shapes_raise():
    w = torch.ones(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="columns"):
        bf16_linear(torch.randn(20, 32), w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_linear(torch.randn(20, 64), w.float())


def test_bf16_linear_over_a_dequantized_copy_equals_its_twin():
    gen = torch.Generator().manual_seed(14)
    for n, k in SHAPES:
        w = _weight(n, k, gen)
        wb = w.to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            y = bf16_linear(x, wb)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert _close(y, ref_bf16_linear(x, wb), x, w), (n, k, rows)
