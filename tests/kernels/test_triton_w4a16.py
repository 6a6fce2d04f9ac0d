"""The W4A16 INT4 matmul (kernels/triton/w4a16.py) in Triton's interpreter against x @ W^T over
the dequantized weights in fp32: tessera's INT4 rows (g32 symmetric, g128 with zero points and a
short last group) and GGUF Q4_0 / Q4_1 block planes, repacked once into the kernel's layout.
Metric: mean |y - ref| / mean |ref| (Marlin's test) below 1e-3, for M in 1..128 on a shape with
ragged N and K tails; outputs and split-K workspaces poisoned with NaN first."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.qgemv import pack_q4_blocks
from kernels.triton import launch_gemm
from kernels.triton.int4_layout import (
    OFFSET_PLANE,
    OFFSET_SYMMETRIC,
    OFFSET_ZEROS,
    Int4Tiles,
    repack_int4_rows,
    repack_q4_blocks,
)
from runtime.quant.linear import Int4Linear, quantize_int4_packed

N, K = 200, 352  # N: one full 128-wide tile and a ragged one; K: 11 groups of 32, 2.75 of 128
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().mean() / ref.abs().mean()).item()


def _tessera(group: int, symmetric: bool) -> tuple[Int4Tiles, torch.Tensor]:
    """Int4Linear's checkpoint tensors repacked; its own fp32 dequantize is the reference."""
    w = torch.randn(N, K) * torch.logspace(-2, 0, N)[:, None]  # scales spread over 100x
    t = quantize_int4_packed(w, group, symmetric)
    lin = Int4Linear(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), K,
                     group, layout="rows")
    tiles = repack_int4_rows(t["weight_packed"], t["weight_scale"],
                             t.get("weight_zero_point"), K, group)
    return tiles, lin.dequantize()


def _q4(kind: str) -> tuple[Int4Tiles, torch.Tensor]:
    """GGUF-style planes, fp16 d (and m): Q4_0 is w = d * (q - 8) (m = -8d), Q4_1 d * q + m."""
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    d = (torch.rand(N, K // 32) * 0.05 + 0.001).half()
    m = (-8 * d.float()).half() if kind == "q4_0" else (torch.randn(N, K // 32) * 0.1).half()
    tiles = repack_q4_blocks(pack_q4_blocks(codes), d, m, 32)
    ref = codes.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    return tiles, ref


FORMATS = {
    "int4-g32-sym": lambda: _tessera(32, True),
    "int4-g128-zeros": lambda: _tessera(128, False),
    "q4_0": lambda: _q4("q4_0"),
    "q4_1": lambda: _q4("q4_1"),
}


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[Int4Tiles, torch.Tensor]]:
    torch.manual_seed(30)
    out = {}
    for name, make in FORMATS.items():
        tiles, ref = make()
        assert not torch.all(tiles.d.float() == 1.0)  # scales present and not unit
        out[name] = (Int4Tiles(tiles.qt.to(DEVICE), tiles.d.to(DEVICE),
                               None if tiles.offset is None else tiles.offset.to(DEVICE),
                               tiles.offset_kind, tiles.group_size), ref)
    return out


def test_repacked_tiles_dequantize_to_the_stored_weights(weights):
    for name, (tiles, ref) in weights.items():
        assert torch.equal(tiles.dequantize().cpu(), ref), name
    kinds = {n: t.offset_kind for n, (t, _) in weights.items()}
    assert kinds == {"int4-g32-sym": OFFSET_SYMMETRIC, "int4-g128-zeros": OFFSET_ZEROS,
                     "q4_0": OFFSET_PLANE, "q4_1": OFFSET_PLANE}


@pytest.mark.parametrize("rows", ROWS)
def test_matches_the_dequantized_reference_for_every_row_count(weights, rows):
    x = (torch.randn(rows, K) * 3).bfloat16()
    for name, (tiles, ref_w) in weights.items():
        ref = x.float() @ ref_w.t()
        out = torch.full((rows, N), float("nan"), device=DEVICE)
        y = launch_gemm.w4a16_linear(x.to(DEVICE), tiles, torch.float32, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert _rel(y.cpu(), ref) < 1e-3, (name, rows, _rel(y.cpu(), ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_output_is_the_reference_rounded_to_it(weights, dtype):
    # a bf16 output alone is ~1.4e-3 from an fp32 reference: compare with the rounded one
    tiles, ref_w = weights["int4-g128-zeros"]
    x = torch.randn(5, K).to(dtype)
    y = launch_gemm.w4a16_linear(x.to(DEVICE), tiles).cpu()
    assert y.dtype == dtype and y.shape == (5, N)
    ref = (x.float() @ ref_w.t()).to(dtype).float()
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-6)


def test_split_k_changes_only_summation_order_and_is_deterministic(weights):
    tiles, ref_w = weights["int4-g32-sym"]
    x = torch.randn(3, K, device=DEVICE).bfloat16()
    ref = x.float().cpu() @ ref_w.t()
    one = launch_gemm.w4a16_linear(x, tiles, torch.float32, split_k=1)
    for splits in (2, 3, 8):  # K is 3 steps of 128: 2 splits them 2 + 1; 8 uses 3
        work = torch.full((splits, 3, N), float("nan"), device=DEVICE)
        y = launch_gemm.w4a16_linear(x, tiles, torch.float32, split_k=splits, workspace=work)
        again = launch_gemm.w4a16_linear(x, tiles, torch.float32, split_k=splits)
        assert torch.equal(y, again), splits
        assert _rel(y.cpu(), ref) < 1e-6 and _rel(y.cpu(), one.cpu()) < 1e-6, splits


def test_leading_dims_are_kept_and_zero_rows_launch_nothing(weights):
    tiles, ref_w = weights["q4_1"]
    x = torch.randn(2, 3, K).bfloat16()
    y = launch_gemm.w4a16_linear(x.to(DEVICE), tiles, torch.float32)
    assert y.shape == (2, 3, N)
    assert _rel(y.cpu(), x.float() @ ref_w.t()) < 1e-3
    empty = launch_gemm.w4a16_linear(torch.empty(0, K, dtype=torch.bfloat16, device=DEVICE),
                                     tiles)
    assert empty.shape == (0, N)


def test_split_count_is_chosen_from_shapes_for_decode_buckets():
    # H200 (132 SMs): the Kimi/GLM shapes split K at decode; a prefill-sized M never does
    assert launch_gemm.w4a16_num_splits(1, 2048, 7168, 132) == 16
    assert launch_gemm.w4a16_num_splits(16, 7168, 2048, 132) == 4
    assert launch_gemm.w4a16_num_splits(32, 7168, 2048, 132) == 4
    assert launch_gemm.w4a16_num_splits(1024, 7168, 2048, 132) == 1
    assert launch_gemm.w4a16_num_splits(1, 2048, 256, 132) == 1  # 2 K steps: nothing to split


def test_layouts_the_kernel_cannot_read_are_refused_at_repack():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.ones(8, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group size"):
        repack_int4_rows(packed, scale, None, 64, 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        repack_int4_rows(packed[:, :24], torch.ones(8, 2, dtype=torch.bfloat16), None, 48, 32)
    with pytest.raises(ValueError, match="scale groups"):
        repack_int4_rows(packed, torch.ones(8, 3, dtype=torch.bfloat16), None, 64, 32)
