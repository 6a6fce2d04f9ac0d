"""Attention and KV ops: torch reference twins (CPU path and test oracle); Triton comes later.

Importing this package never needs a GPU.
"""

from kernels.paged_attention import (
    decode_pads_to_longest,
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
)
from kernels.store_kv import ref_store_kv, store_kv

__all__ = [
    "decode_pads_to_longest",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_store_kv",
    "store_kv",
]
