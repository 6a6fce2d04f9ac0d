"""Serving formats as pure tensor functions: FP8 e4m3 and INT4 group-wise (quantize, dequantize,
pack). Modules holding packed weights and the model converter build on these."""

from runtime.quant.fp8 import (
    FP8_MAX,
    decode_e4m3_bits,
    dequantize_fp8_kv,
    dequantize_fp8_per_channel,
    quantize_fp8_kv,
    quantize_fp8_per_channel,
)
from runtime.quant.int4 import (
    dequantize_int4_groupwise,
    pack_int4,
    quantize_int4_groupwise,
    unpack_int4,
)

__all__ = [
    "FP8_MAX",
    "decode_e4m3_bits",
    "dequantize_fp8_kv",
    "dequantize_fp8_per_channel",
    "dequantize_int4_groupwise",
    "pack_int4",
    "quantize_fp8_kv",
    "quantize_fp8_per_channel",
    "quantize_int4_groupwise",
    "unpack_int4",
]
