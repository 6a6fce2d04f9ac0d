"""Symmetric INT8 KV as pure tensor functions, and the dispatch between the two 1-byte formats.

INT8 pages carry exactly what FP8 pages carry (kernels/fp8.py): one byte per element and one
bf16 scale per (token, KV head), so the same bytes and the same >= 1.9x capacity over BF16. The
scale is amax / 127, rounded to bf16 first, and the data divided by the rounded scale, rounded
to nearest (ties to even) and clamped to [-127, 127] (-128 is never written: the grid is
symmetric); NaN becomes 0 and +-inf the clamp. Why int8 rather than e4m3 for rotated K and V:
e4m3 keeps ~3 mantissa bits at every magnitude, a floating-point grid made for heavy-tailed
data; after the Hadamard rotation (kernels/hadamard.py) a row is near-Gaussian with no
outliers, and 255 uniform levels spread over its amax hold it with ~4x less error (measured in
ops/bench/RESULTS.md#kv-format-quality). The method is the per-token, per-head round-to-nearest of
QuaRot's rotated KV cache (Ashkboos et al. 2024, sec. 4) and of LMDeploy's online KV int8; both
add a zero point, which this format leaves out: rotated (and key-mean-shifted) rows are
centred, and a symmetric grid keeps FP8's exact layout, one bf16 scale per row. Decoding is one
int8 -> float convert and a multiply, as cheap in registers as e4m3's bit decode.

The two formats are told apart by their page storage dtype, everywhere: e4m3 bytes are kept
as uint8, int8 as int8 (`QUANTIZED_KV_DTYPES`).
"""

from __future__ import annotations

import torch

from kernels.fp8 import decode_e4m3_bits, quantize_fp8_kv

INT8_MAX = 127.0
_MIN_SCALE = 1e-12
QUANTIZED_KV_DTYPES = (torch.uint8, torch.int8)  # e4m3 bytes, symmetric int8


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether pages of this storage dtype are a 1-byte format with a scale per token and head."""
    return dtype in QUANTIZED_KV_DTYPES


def int8_scale(amax: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The scale that maps `amax` onto 127, in `dtype`: never zero, NaN or inf."""
    amax = torch.nan_to_num(amax.float(), nan=0.0, posinf=torch.finfo(torch.float32).max)
    return (amax / INT8_MAX).clamp(min=_MIN_SCALE).to(dtype)


def quantize_int8_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [tokens, heads, dim] -> (int8 [tokens, heads, dim], bf16 scales [tokens, heads])
    scale = int8_scale(x.abs().amax(dim=-1))
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=INT8_MAX * 2, neginf=-INT8_MAX * 2)
    q = (finite / scale.float()[..., None]).clamp(-INT8_MAX, INT8_MAX).round().to(torch.int8)
    return q, scale


def dequantize_int8_kv(q: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (codes in the page storage dtype, bf16 scales [tokens, heads])
    for uint8 (e4m3 bytes) or int8 pages."""
    if storage == torch.int8:
        return quantize_int8_kv(x)
    if storage == torch.uint8:
        q, s = quantize_fp8_kv(x)
        return q.view(torch.uint8), s
    raise ValueError(f"{storage} pages are not a quantized KV format")


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes of uint8 (e4m3 bytes) or int8 pages times their per-row scale, in `dtype`."""
    if q.dtype == torch.int8:
        return dequantize_int8_kv(q, scale, dtype)
    return (decode_e4m3_bits(q) * scale.float()[..., None]).to(dtype)


def decode_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes of uint8 (e4m3 bytes) or int8 pages as float32 values, unscaled."""
    return q.float() if q.dtype == torch.int8 else decode_e4m3_bits(q)
