"""Symmetric INT8 KV as tensor functions: the stated quantization (amax / 127 in bf16, round to
nearest, clamp to +-127), no NaN or inf on outliers, 1.9x the tokens of BF16 per byte, and less
error than e4m3 on rotated (near-Gaussian) rows at the same bytes."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import dequantize_fp8_kv, quantize_fp8_kv
from kernels.hadamard import fwht
from kernels.int8 import (
    INT8_MAX,
    decode_codes,
    dequantize_int8_kv,
    dequantize_kv,
    is_quantized_kv,
    quantize_int8_kv,
    quantize_kv,
)


@pytest.mark.parametrize("shape", [(1, 1, 64), (7, 3, 17), (33, 2, 128)])
def test_int8_kv_is_symmetric_round_to_nearest_of_amax_over_127(shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None, None]
    q, scale = quantize_int8_kv(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == shape[:2]
    want_scale = (x.abs().amax(-1) / 127).to(torch.bfloat16)
    assert torch.equal(scale, want_scale)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    want = torch.round(x / scale.float()[..., None]).clamp(-127, 127)
    assert torch.equal(q.float(), want)
    back = dequantize_int8_kv(q, scale)
    # half a level, plus the bf16 rounding of the scale pulling the amax element past 127
    bound = scale.float()[..., None] * 0.5 + x.abs().amax(-1, keepdim=True) * 2**-8
    assert bool(((back - x).abs() <= bound).all())


def test_int8_kv_survives_outliers_zeros_and_non_finite_values():
    x = torch.randn(5, 3, 64)
    x[0, 1, 7] = 1e6  # an outlier only costs its own token and head
    x[2] = 0.0
    x[3, 0, 0] = float("inf")
    x[4, 2, 5] = float("nan")
    q, scale = quantize_int8_kv(x)
    back = dequantize_int8_kv(q, scale)
    assert bool(torch.isfinite(back).all()) and bool(torch.isfinite(scale.float()).all())
    assert torch.equal(back[2], torch.zeros(3, 64))
    assert int(q[4, 2, 5]) == 0  # NaN -> 0; an inf row gets a huge finite scale, as in fp8
    assert abs(float(back[0, 1, 7]) - 1e6) <= 1e6 * 2**-8
    clean = torch.ones(5, 3, dtype=torch.bool)
    clean[0, 1] = clean[3, 0] = clean[4, 2] = False
    err = (back - x).abs()[clean]
    assert float(err.max()) <= float(x.abs()[clean].max()) / 127


def test_int8_kv_keeps_at_least_1_9x_the_tokens_of_bf16_per_byte():
    head_dim = 64
    assert head_dim * 2 / (head_dim * 1 + 2) >= 1.9  # one bf16 scale per token per head


def test_rotated_rows_lose_several_times_less_in_int8_than_in_e4m3():
    """Why int8: a rotated row is near-Gaussian; 255 uniform levels over its amax beat e4m3's
    ~3 mantissa bits everywhere but near zero."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, 64, generator=gen)
    x[:, :, 9] *= 20.0  # an outlier channel, spread over the row by the rotation
    r = fwht(x)
    e_int8 = (dequantize_int8_kv(*quantize_int8_kv(r)) - r).norm() / r.norm()
    e_fp8 = (dequantize_fp8_kv(*quantize_fp8_kv(r)) - r).norm() / r.norm()
    assert float(e_int8) < 0.4 * float(e_fp8)


def test_the_format_generic_helpers_dispatch_on_the_page_dtype():
    x = torch.randn(4, 2, 32)
    q8, s8 = quantize_kv(x, torch.int8)
    qf, sf = quantize_kv(x, torch.uint8)
    assert q8.dtype == torch.int8 and qf.dtype == torch.uint8
    assert torch.equal(dequantize_kv(q8, s8), dequantize_int8_kv(*quantize_int8_kv(x)))
    assert torch.equal(dequantize_kv(qf, sf),
                       dequantize_fp8_kv(*quantize_fp8_kv(x)))
    assert torch.equal(decode_codes(q8), q8.float())
    assert is_quantized_kv(torch.int8) and is_quantized_kv(torch.uint8)
    assert not is_quantized_kv(torch.bfloat16)
    with pytest.raises(ValueError, match="not a quantized KV format"):
        quantize_kv(x, torch.bfloat16)
    assert INT8_MAX == 127.0
