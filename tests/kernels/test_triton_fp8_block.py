"""The block-FP8 matmul and its activation quantizer (kernels/triton/fp8_block.py) in Triton's
interpreter: the quantizer bit for bit its torch twin `ref_quant_fp8_groups` (codes and fp32
scales, every e4m3 value and rounding tie, NaN/inf/zero groups); the matmul against the
dequantized fp32 reference, mean |y - ref| / mean |ref| < 1e-3 for M in 1..128, ragged N and K,
DeepSeek-V3's 128x128 weight_scale_inv and tessera's per-row expansion, outputs poisoned."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.triton import launch_gemm
from kernels.triton.gemm_ref import ref_dequant_fp8_blocks, ref_quant_fp8_groups
from runtime.quant.fp8 import expand_block_rows, quantize_fp8_blockwise

N, K = 200, 320  # ragged: N past one 128 tile and one weight block, K 2.5 groups of 128
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().mean() / ref.abs().mean()).item()


@pytest.fixture(scope="module")
def weight() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(31)
    w = torch.randn(N, K) * torch.logspace(-3, 1, N)[:, None]  # blocks 10^4 apart
    q, scale_inv = quantize_fp8_blockwise(w)
    assert scale_inv.shape == (2, 3) and not torch.all(scale_inv == 1.0)
    return q.to(DEVICE), scale_inv.to(DEVICE), ref_dequant_fp8_blocks(q, scale_inv, 128)


def test_quantizer_is_bit_for_bit_its_twin_on_ragged_rows_and_bad_values():
    rows = 6
    x = torch.randn(rows, K) * torch.logspace(-4, 3, rows)[:, None]
    x[1, :128] = 0.0  # an all-zero group: the minimum scale, zero codes
    x[2, 5], x[3, 200], x[4, 300] = float("nan"), float("inf"), -float("inf")
    x = x.bfloat16()
    q, s = launch_gemm.quant_fp8_groups(x.to(DEVICE))
    rq, rs = ref_quant_fp8_groups(x)
    assert q.dtype == torch.uint8 and s.shape == (rows, 3) and s.dtype == torch.float32
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu(), rq)
    assert not torch.isnan(q.cpu().view(torch.float8_e4m3fn).float()).any()


def test_quantizer_rounds_every_e4m3_value_and_tie_as_torch_does():
    # groups holding 448 get scale exactly 1, so the kernel encodes these values as given
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[~values.isnan()].unique()
    ties = (values[1:] + values[:-1]) / 2  # halfway between neighbours: round to even
    probes = torch.cat([values, ties, ties.nextafter(torch.tensor(0.0))]).clamp(-448, 448)
    probes = probes[probes.abs() < 448]
    groups = -(-probes.numel() // 127)
    x = torch.full((groups, 128), 448.0)
    x.view(-1)[torch.arange(probes.numel()) // 127 * 128 + torch.arange(probes.numel()) % 127
               + 1] = probes
    q, s = launch_gemm.quant_fp8_groups(x.to(DEVICE))
    assert torch.all(s.cpu() == 1.0)
    assert torch.equal(q.cpu(), ref_quant_fp8_groups(x)[0])


@pytest.mark.parametrize("rows", ROWS)
def test_matmul_matches_the_dequantized_reference_for_every_row_count(weight, rows):
    wq, scale_inv, ref_w = weight
    x = (torch.randn(rows, K) * torch.logspace(-1, 2, rows)[:, None]).bfloat16()
    aq, a_s = ref_quant_fp8_groups(x)
    ref = ref_dequant_fp8_blocks(aq, a_s, 1) @ ref_w.t()
    aq, a_s = aq.to(DEVICE), a_s.to(DEVICE)
    for scales in (scale_inv, expand_block_rows(scale_inv, N, 128)):
        out = torch.full((rows, N), float("nan"), device=DEVICE)
        y = launch_gemm.fp8_block_matmul(aq, a_s, wq, scales, torch.float32, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert _rel(y.cpu(), ref) < 1e-3, (rows, scales.shape, _rel(y.cpu(), ref))


def test_linear_quantizes_then_multiplies_into_bf16(weight):
    wq, scale_inv, ref_w = weight
    x = torch.randn(2, 5, K).bfloat16()
    y = launch_gemm.fp8_block_linear(x.to(DEVICE), wq, scale_inv).cpu()
    assert y.shape == (2, 5, N) and y.dtype == torch.bfloat16
    aq, a_s = ref_quant_fp8_groups(x.view(10, K))
    ref = (ref_dequant_fp8_blocks(aq, a_s, 1) @ ref_w.t()).bfloat16().float()
    torch.testing.assert_close(y.view(10, N).float(), ref, rtol=2**-7, atol=1e-5)


def test_mismatched_scales_are_refused(weight):
    wq, scale_inv, _ = weight
    aq, a_s = ref_quant_fp8_groups(torch.randn(4, K))
    with pytest.raises(AssertionError):
        launch_gemm.fp8_block_matmul(aq.to(DEVICE), a_s[:, :2].to(DEVICE), wq, scale_inv)
    with pytest.raises(AssertionError):
        launch_gemm.fp8_block_matmul(aq.to(DEVICE), a_s.to(DEVICE), wq, scale_inv[:1])
