"""The block linear's one choice of kernel (`block_linear_out`, kernels/cpu/qgemv.cpp): int8
limbs of x at every row count (batch invariance), float32 x with no limbs, Q4 or Q8 by the
planes' dtype; bit for bit the kernel it chooses, and its twin within the kernels' tolerances."""

from __future__ import annotations

import pytest
import torch

from kernels.block_linear import block_linear, ref_block_linear
from kernels.qgemv import pack_q4_blocks, q4_linear
from kernels.qgemv_i8 import int8_kernels_available, q4_linear_i8, q8_linear_i8

pytestmark = pytest.mark.skipif(not int8_kernels_available(),
                                reason="no C++ build with the int8 (VNNI) kernels")

N, K = 70, 576


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Micro-sized matmuls: one thread is faster and quieter on a shared box."""


def _q4(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    d = (torch.rand(N, K // 32, generator=gen) * 0.02 + 0.001).half()
    m = (torch.randn(N, K // 32, generator=gen) * 0.1).half()
    return pack_q4_blocks(codes), d, m


def _q8(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    qs = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    return qs, (torch.rand(N, K // 32, generator=gen) * 0.01).half()


@pytest.mark.parametrize("limbs", [1, 2])
def test_int8_limbs_run_at_every_row_count(limbs):
    gen = torch.Generator().manual_seed(1)
    qs, d, m = _q4(gen)
    q8, d8 = _q8(gen)
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, K, generator=gen)
        want4, want8 = q4_linear_i8(x, qs, d, m, limbs=limbs), q8_linear_i8(x, q8, d8,
                                                                          limbs=limbs)
        assert torch.equal(block_linear(x, qs, d, m, limbs=limbs), want4), rows
        assert torch.equal(block_linear(x, q8, d8, limbs=limbs), want8), rows


def test_no_limbs_is_the_float32_kernel_for_every_offset_form():
    gen = torch.Generator().manual_seed(2)
    qs, d, m = _q4(gen)
    zeros = torch.randint(0, 256, (N * 5 // 2,), dtype=torch.uint8, generator=gen)
    scale = torch.rand(N, 5, generator=gen).bfloat16()  # g128 over 576 inputs: a short last group
    x = torch.randn(3, 2, K, generator=gen)  # leading dimensions are kept
    assert torch.equal(block_linear(x, qs, d, m), q4_linear(x, qs, d, m, 32))
    assert torch.equal(block_linear(x, qs, scale, None, zeros, 128),
                       q4_linear(x, qs, scale, None, 128, zeros))
    y = block_linear(x, qs, scale, None, None, 128)
    assert y.shape == (3, 2, N)
    ref = ref_block_linear(x.view(6, K), qs, scale, None, None, 128, 0)
    # float32 sums in another order than the twin's
    torch.testing.assert_close(y.view(6, N), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_int8_limbs_over_planes_without_offsets_are_refused():
    gen = torch.Generator().manual_seed(3)
    qs, d, _ = _q4(gen)
    x = torch.randn(2, K, generator=gen)
    with pytest.raises(RuntimeError, match="offsets"):
        block_linear(x, qs, d, None, limbs=2)
    with pytest.raises(ValueError, match="limbs"):
        block_linear(x, qs, d, None, limbs=3)

