"""The int8-activation block kernels (kernels/cpu/qgemv_i8.cpp) against their torch twins:
sizes swept (powers of two, odd block counts, a part quad and a part chunk of 16 blocks),
row counts over every tile and its remainders, random inputs with an all-zero block and
extreme codes, poisoned outputs, one and two int8 limbs of x; and their distance from the
float32-activation twin."""

from __future__ import annotations

import pytest
import torch

from kernels.qgemv import pack_q4_blocks, ref_q4_linear, ref_q8_linear
from kernels.qgemv_i8 import (
    int8_kernels_available,
    q4_linear_i8,
    q8_linear_i8,
    ref_q4_linear_i8,
    ref_q8_linear_i8,
    ref_quantize_limbs,
    ref_quantize_rows_q8,
)

needs_kernels = pytest.mark.skipif(not int8_kernels_available(),
                                   reason="no AVX-512 VNNI here: the twins run alone")

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 64)  # tiles of 8, 4, 2 and 1 rows and their remainders
# (N, K): 1..48 blocks a row (odd counts, part quads, part chunks of 16 scales), N over panels
# of 16 weight rows and their ragged ends
SHAPES = ((1, 32), (3, 96), (7, 160), (64, 64), (13, 544), (129, 576), (50, 1536))
PANEL_ROWS = (1, 2, 5, 16, 17, 33, 128, 300)  # x rows over every tile height and remainder
PANEL_SHAPES = ((15, 96), (16, 160), (17, 544), (33, 576), (70, 1536))  # N ragged to 16
POISON = float("nan")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Micro-sized matmuls: one thread is faster and quieter on a shared box."""


def planes(n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q8[0, :32] = -128  # the flip to unsigned at its edge
    return {"qs": pack_q4_blocks(codes), "q8": q8,
            "d": (torch.randn(n, k // 32, generator=gen) * 0.02).half(),
            "m": (torch.randn(n, k // 32, generator=gen) * 0.1).half()}


def activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    if k >= 64:
        x[-1, 32:64] *= 300.0  # an outlier block, as SmolLM2's large channels are
    return x


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # the integer dots are exact: only float32 sums of K/32 scaled terms differ in order
    assert torch.isfinite(y).all()
    scale = ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-3)
    assert ((y - ref).abs() <= 2e-5 * scale + 1e-6).all(), float(((y - ref).abs()).max())


def test_quantized_rows_round_half_to_even_within_half_a_step():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -63.5] + [0.0] * 27])
    xq, dx = ref_quantize_rows_q8(x)
    assert dx.tolist() == [[1.0]]
    assert xq[0, :5].tolist() == [127, 0, 0, 2, -64]  # half to even, as the CPU rounds
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 576, generator=gen)
    xq, dx = ref_quantize_rows_q8(x)
    back = xq.float().view(4, 18, 32) * dx.unsqueeze(-1)
    assert ((back - x.view(4, 18, 32)).abs() <= dx.unsqueeze(-1) / 2 + 1e-7).all()


@needs_kernels
@pytest.mark.parametrize("limbs", [1, 2])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_int8_kernel_equals_its_twin_over_sizes_and_row_counts(kind, limbs):
    gen = torch.Generator().manual_seed(7 if kind == "q4" else 8)
    for n, k in SHAPES:
        w = planes(n, k, gen)
        for rows in ROWS:
            x = activations(rows, k, gen)
            out = torch.full((rows, n), POISON)
            if kind == "q4":
                y = q4_linear_i8(x, w["qs"], w["d"], w["m"], out=out, limbs=limbs)
                ref = ref_q4_linear_i8(x, w["qs"], w["d"], w["m"], limbs)
            else:
                y = q8_linear_i8(x, w["q8"], w["d"], out=out, limbs=limbs)
                ref = ref_q8_linear_i8(x, w["q8"], w["d"], limbs)
            assert y.data_ptr() == out.data_ptr()
            assert_close(y, ref)


@needs_kernels
def test_int8_kernel_takes_leading_dims_and_refuses_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    w = planes(40, 96, gen)
    x = activations(6, 96, gen).view(2, 3, 96)
    y = q4_linear_i8(x, w["qs"], w["d"], w["m"])
    assert y.shape == (2, 3, 40)
    assert_close(y.view(6, 40), ref_q4_linear_i8(x.view(6, 96), w["qs"], w["d"], w["m"]))
    with pytest.raises(RuntimeError, match="columns"):
        q4_linear_i8(torch.randn(2, 64), w["qs"], w["d"], w["m"])
    with pytest.raises(RuntimeError, match="float16"):
        q8_linear_i8(torch.randn(2, 96), w["q8"], w["d"].float())
    with pytest.raises(ValueError, match="limbs"):
        q4_linear_i8(torch.randn(2, 96), w["qs"], w["d"], w["m"], limbs=3)


def test_int8_activations_stay_within_their_rounding_of_the_float32_result():
    # |x - dx xq| <= dx / 2 per element, so |y_int8 - y_fp32| <= sum_j |w_j| dx_j / 2.
    gen = torch.Generator().manual_seed(5)
    w = planes(64, 576, gen)
    x = activations(8, 576, gen)
    _, dx = ref_quantize_rows_q8(x)
    half_step = (dx / 2).repeat_interleave(32, dim=1)  # [rows, K]
    for ref_f32, ref_i8, dense in (
        (ref_q4_linear(x, w["qs"], w["d"], w["m"], 32), ref_q4_linear_i8(x, w["qs"], w["d"],
                                                                          w["m"]), "q4"),
        (ref_q8_linear(x, w["q8"], w["d"]), ref_q8_linear_i8(x, w["q8"], w["d"]), "q8"),
    ):
        from kernels.qgemv import ref_q4_dequantize, ref_q8_dequantize

        wd = (ref_q4_dequantize(w["qs"], w["d"], w["m"], 32) if dense == "q4"
              else ref_q8_dequantize(w["q8"], w["d"]))
        bound = half_step @ wd.abs().t()
        assert ((ref_i8 - ref_f32).abs() <= bound * 1.001 + 1e-5).all()
        assert (ref_i8 - ref_f32).abs().max() > 0  # it is a rounding, not the same numbers


def test_two_limbs_carry_x_to_its_residual_rounding():
    # x = dx xq + dx2 xq2 + e with |e| <= dx2 / 2 <= dx / 508: the result's distance from the
    # float32 twin is bounded by that, and is hundreds of times below one limb's.
    gen = torch.Generator().manual_seed(6)
    w = planes(64, 576, gen)
    x = activations(8, 576, gen)
    (_, dx), (_, dx2) = ref_quantize_limbs(x, 2)
    assert (dx2 <= dx / 254 * (1 + 1e-6)).all()
    half_step = (dx2 / 2).repeat_interleave(32, dim=1)
    from kernels.qgemv import ref_q4_dequantize

    wd = ref_q4_dequantize(w["qs"], w["d"], w["m"], 32)
    exact = x.double() @ wd.double().t()
    two = ref_q4_linear_i8(x, w["qs"], w["d"], w["m"], 2).double()
    one = ref_q4_linear_i8(x, w["qs"], w["d"], w["m"], 1).double()
    bound = half_step.double() @ wd.abs().double().t()
    assert ((two - exact).abs() <= bound * 1.001 + 1e-5).all()
    assert (one - exact).abs().mean() > 100 * (two - exact).abs().mean()


def _run_i8(kind: str, x: torch.Tensor, w: dict[str, torch.Tensor], limbs: int) -> torch.Tensor:
    out = torch.full((x.shape[0], w["d"].shape[0]), POISON)
    if kind == "q4":
        return q4_linear_i8(x, w["qs"], w["d"], w["m"], out=out, limbs=limbs)
    return q8_linear_i8(x, w["q8"], w["d"], out=out, limbs=limbs)


@needs_kernels
@pytest.mark.parametrize("limbs", [1, 2])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_every_row_of_a_many_row_call_is_its_one_row_call_and_the_twin(kind, limbs):
    # the register tiles (8, 4, 2, 1 rows of x against panels of 16 weight rows) give row i of
    # an M-row call the bits of x[i] alone, at ragged N, and stay the twin's numbers
    gen = torch.Generator().manual_seed(11 if kind == "q4" else 12)
    for n, k in PANEL_SHAPES:
        w = planes(n, k, gen)
        x = activations(max(PANEL_ROWS), k, gen)
        alone = torch.cat([_run_i8(kind, x[i : i + 1], w, limbs) for i in range(x.shape[0])])
        for rows in PANEL_ROWS:
            assert torch.equal(_run_i8(kind, x[:rows], w, limbs), alone[:rows]), (n, k, rows)
        ref = (ref_q4_linear_i8(x, w["qs"], w["d"], w["m"], limbs) if kind == "q4"
               else ref_q8_linear_i8(x, w["q8"], w["d"], limbs))
        assert_close(alone, ref)
