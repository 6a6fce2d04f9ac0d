"""GPTQ for FP8 weights: the scales stay the round-to-nearest format's (per channel, or
DeepSeek-V3's 128x128 blocks), only the e4m3 codes change, and the layer-output error on
correlated calibration inputs falls well below round-to-nearest's; bad Hessians are refused."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import InvalidArgument
from runtime.quant.fp8 import (
    dequantize_fp8_per_channel,
    dequantize_fp8_row_blocks,
    expand_block_rows,
    quantize_fp8_blockwise,
    quantize_fp8_per_channel,
)
from runtime.quant.gptq_fp8 import gptq_fp8


def _correlated_inputs(tokens: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, 32, generator=gen) @ torch.randn(32, dim, generator=gen)
    x += 0.3 * torch.randn(tokens, dim, generator=gen)
    x[:, :4] *= 20  # outlier channels, as real activations have
    return x


def _output_error(w: torch.Tensor, w_q: torch.Tensor, hessian: torch.Tensor) -> float:
    """Sum over calibration inputs of ||x (w - w_q)^T||^2 = trace(D H D^T)."""
    d = (w - w_q).double()
    return float(torch.einsum("oi,ij,oj->", d, hessian.double(), d))


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    if block is None:
        return dequantize_fp8_per_channel(q, scale)
    return dequantize_fp8_row_blocks(q, expand_block_rows(scale, q.shape[0], block[0]), block[1])


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_gptq_fp8_keeps_the_scales_and_lowers_the_output_error(block):
    gen = torch.Generator().manual_seed(3)
    x = _correlated_inputs(2048, 320, gen)  # 320 = 2.5 column blocks of 128
    w = torch.randn(200, 320, generator=gen) * 0.05
    hessian = x.T.double() @ x.double()
    rtn_q, rtn_scale = (quantize_fp8_per_channel(w) if block is None
                        else quantize_fp8_blockwise(w, block))
    q, scale = gptq_fp8(w, hessian, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(scale, rtn_scale)
    rtn_error = _output_error(w, _dequantize(rtn_q, rtn_scale, block), hessian)
    assert _output_error(w, _dequantize(q, scale, block), hessian) < 0.5 * rtn_error


def test_gptq_fp8_refuses_a_hessian_that_does_not_fit_or_is_not_finite():
    w = torch.randn(8, 16)
    with pytest.raises(InvalidArgument, match="does not match"):
        gptq_fp8(w, torch.eye(12), name="layers.0.q_proj.weight")
    bad = torch.eye(16)
    bad[3, 3] = float("nan")
    with pytest.raises(InvalidArgument, match="not finite"):
        gptq_fp8(w, bad)
