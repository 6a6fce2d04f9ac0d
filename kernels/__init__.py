"""Attention and KV ops and the 1-byte KV formats (FP8 e4m3, symmetric INT8): torch
reference twins (CPU path and test oracle) and C++ CPU ops; Triton comes later.

Every kernel is a `torch.ops.tessera` op, declared once in `kernels/ops.py` (schema, fake,
torch twin), with per-device kernels registered into it: `kernels/ops.py` says how a CUDA
kernel is registered. Importing this package declares the ops and never needs a GPU.
"""

from kernels import ops  # declares every op (schema, fake, twin)
from kernels.fp8 import FP8_MAX, decode_e4m3_bits, dequantize_fp8_kv, fp8_scale, quantize_fp8_kv
from kernels.int8 import (
    INT8_MAX,
    dequantize_int8_kv,
    dequantize_kv,
    is_quantized_kv,
    quantize_int8_kv,
    quantize_kv,
)
from kernels.latent import dequantize_latent_pages, dequantize_latent_rows, rope_view
from kernels.moe import fused_moe, moe_align, ref_fused_moe
from kernels.paged_attention import (
    decode_pads_to_longest,
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
)
from kernels.store_kv import ref_store_kv, store_kv, store_latent

__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "decode_e4m3_bits",
    "decode_pads_to_longest",
    "dequantize_fp8_kv",
    "dequantize_int8_kv",
    "dequantize_kv",
    "dequantize_latent_pages",
    "dequantize_latent_rows",
    "fp8_scale",
    "fused_moe",
    "is_quantized_kv",
    "moe_align",
    "ops",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_fp8_kv",
    "quantize_int8_kv",
    "quantize_kv",
    "ref_fused_moe",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_store_kv",
    "rope_view",
    "store_kv",
    "store_latent",
]
