"""Serving formats in three layers: pure tensor functions (FP8 e4m3 weights, INT4 group-wise),
linear modules holding packed weights (`linear.py`), and the model converter (`convert.py`).
FP8 KV and the e4m3 decode are `kernels.fp8`'s."""

from runtime.quant.convert import convert_model, linear_weight_bytes
from runtime.quant.fp8 import dequantize_fp8_per_channel, quantize_fp8_per_channel
from runtime.quant.int4 import (
    dequantize_int4_groupwise,
    pack_int4,
    quantize_int4_groupwise,
    unpack_int4,
)
from runtime.quant.linear import Fp8Linear, Int4Linear, quantize_int4_packed

__all__ = [
    "Fp8Linear",
    "Int4Linear",
    "convert_model",
    "dequantize_fp8_per_channel",
    "dequantize_int4_groupwise",
    "linear_weight_bytes",
    "pack_int4",
    "quantize_fp8_per_channel",
    "quantize_int4_groupwise",
    "quantize_int4_packed",
    "unpack_int4",
]
