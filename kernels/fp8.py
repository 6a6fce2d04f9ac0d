"""FP8 e4m3 as pure tensor functions: KV quantize/dequantize and the exact e4m3 bit decode.

KV carries one bf16 scale per token per KV head. Why: a page is written one token at a time,
so a per-page or per-tensor scale would have to be known before the page's later tokens exist
(or pages requantized as they fill); per-token scales are final when the token is written, and
outliers (a few activations 100x the rest) only cost their own token and head. Stored as bf16
the scale costs 2 bytes per head_dim bytes of data: for head_dim 64, 66 bytes vs BF16's 128,
1.94x the tokens in the same bytes (>= 1.9 required). Scales are computed from amax, rounded to
their stored dtype first and the data divided by the rounded scale, then clamped to the e4m3
range, so nothing overflows to NaN (e4m3fn has no inf) whatever the activations.
`runtime/quant/fp8.py` builds the per-channel weight format on `fp8_scale`.
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_MIN_SCALE = 1e-12
_E4M3_TO_F32 = 2.0**120  # e4m3 bits shifted into an fp32 pattern are the value times 2**-120


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps `amax` onto FP8_MAX, in `dtype`: never zero, NaN or inf."""
    amax = torch.nan_to_num(amax.float(), nan=0.0, posinf=torch.finfo(torch.float32).max)
    return (amax / FP8_MAX).clamp(min=_MIN_SCALE).to(dtype)


def quantize_fp8_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [tokens, heads, dim] -> (fp8 [tokens, heads, dim], bf16 scales [tokens, heads])
    scale = fp8_scale(x.abs().amax(dim=-1), torch.bfloat16)
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=FP8_MAX * 2, neginf=-FP8_MAX * 2)
    q = (finite / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_kv(q: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (decode_e4m3_bits(q) * scale.float()[..., None]).to(dtype)


def decode_e4m3_bits(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn (or its bytes as uint8) -> float32 with integer bit operations: exact for every
    finite value, and far cheaper than a plain cast on CPU once compiled (the cast is a
    per-element call)."""
    b = q.view(torch.uint8).to(torch.int32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return bits.view(torch.float32) * _E4M3_TO_F32


def ref_fp8_dequantize(q: torch.Tensor, scale: torch.Tensor,
                       block_of_col: torch.Tensor | None) -> torch.Tensor:
    """e4m3 weight [out, in] (or its bytes, uint8) -> float32 [out, in]: times `scale` [out] per
    row, or with `block_of_col` ([in] column -> its block) `scale` [out, blocks] per (row,
    column block)."""
    # NOTE: not repeat_interleave: compiled, it gave NaN here (torch 2.13 CPU inductor)
    if block_of_col is None:
        return decode_e4m3_bits(q) * scale[:, None]
    return decode_e4m3_bits(q) * scale.index_select(1, block_of_col)


@functools.cache
def _compiled_fp8_dequantize():
    return torch.compile(ref_fp8_dequantize, dynamic=False)


def cpu_fp8_dequantize(q: torch.Tensor, scale: torch.Tensor,
                       block_of_col: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel: the twin compiled for the weight's static shape (eager, the e4m3 cast
    is a per-element call on CPU: 4.9-6.4 ms against 0.27-0.29 ms compiled;
    runtime/quant/linear.py)."""
    return _compiled_fp8_dequantize()(q, scale, block_of_col)
