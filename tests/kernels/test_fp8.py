"""FP8 e4m3 KV as tensor functions: no NaN or inf on outliers, 1.9x the tokens of BF16 per
byte, and an exact bit decode."""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, decode_e4m3_bits, dequantize_fp8_kv, quantize_fp8_kv


def test_fp8_kv_survives_outliers_zeros_and_non_finite_values():
    x = torch.randn(5, 3, 64)
    x[0, 1, 7] = 1e6  # an outlier only costs its own token and head
    x[2] = 0.0
    x[3, 0, 0] = float("inf")
    x[4, 2, 5] = float("nan")
    q, scale = quantize_fp8_kv(x)
    back = dequantize_fp8_kv(q, scale)
    assert scale.dtype == torch.bfloat16 and scale.shape == (5, 3)
    assert bool(torch.isfinite(back).all())
    assert torch.equal(back[2], torch.zeros(3, 64))
    clean = torch.ones(5, 3, dtype=torch.bool)
    clean[0, 1] = clean[3, 0] = clean[4, 2] = False
    err = (back - x).abs()[clean]
    assert float(err.max()) <= float(x.abs()[clean].max()) * 2**-3
    assert abs(float(back[0, 1, 7]) - 1e6) <= 1e6 * 2**-3


def test_fp8_kv_keeps_at_least_1_9x_the_tokens_of_bf16_per_byte():
    head_dim = 64
    bf16_bytes = head_dim * 2
    fp8_bytes = head_dim * 1 + 2  # one bf16 scale per token per head
    assert bf16_bytes / fp8_bytes >= 1.9


def test_e4m3_bit_decode_is_exact_for_every_finite_byte():
    raw = torch.arange(256, dtype=torch.uint8)
    q = raw.view(torch.float8_e4m3fn)
    want = q.to(torch.float32)
    finite = torch.isfinite(want)
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are NaN in e4m3fn
    assert torch.equal(decode_e4m3_bits(q)[finite], want[finite])
    assert float(want[finite].abs().max()) == FP8_MAX
