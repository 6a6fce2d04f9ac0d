"""Write new tokens' K and V into their page slots, in place (quantizing for 1-byte pages).

On CPU the C++ op (`kernels/cpu/store_kv.cpp`) does each of K and V in one call, bit for bit
the torch twin's result. Quantized pages are fp8 e4m3 bytes (uint8) or symmetric int8, each
with a bf16 scale per (token, head) (`kernels/fp8.py`, `kernels/int8.py`). With `hadamard`,
quantized pages get the rows' Walsh-Hadamard rotation (`kernels/hadamard.py`), quantized; other
page formats ignore it. Smoothed quantized pages (`runtime/kv/smoothing.py`) store
(x - shift) / divisor per (head, channel), before the rotation (`k_shift`, `k_divisor`,
`v_divisor`: [kv_heads, dim] float32 or None).
"""

from __future__ import annotations

import torch

from kernels.cpu_ops import native_ops
from kernels.hadamard import fwht
from kernels.int8 import is_quantized_kv, quantize_kv
from kernels.latent import ref_store_latent


def ref_store_rows(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None,
                   slot_mapping: torch.Tensor, hadamard: bool,
                   shift: torch.Tensor | None = None,
                   divisor: torch.Tensor | None = None) -> None:
    """Twin of the `store_kv_rows` op: x [tokens, heads, dim] into cache [heads, pages,
    page_size, dim] at flat slots [tokens] (quantized pages: codes, and scales [heads, pages,
    page_size] bf16)."""
    heads, pages, page_size, dim = cache.shape
    if not is_quantized_kv(cache.dtype):
        assert shift is None and divisor is None, "smoothing is for quantized pages"
    else:
        assert scale is not None and scale.shape == (heads, pages, page_size), \
            "quantized pages need scales"
        x = x if shift is None else x - shift
        x = x if divisor is None else x / divisor
        # x: [tokens, heads, dim] codes in the page dtype; s: [tokens, heads] bf16
        x, s = quantize_kv(fwht(x) if hadamard else x, cache.dtype)
        scale.view(heads, pages * page_size).index_copy_(1, slot_mapping, s.t().to(scale.dtype))
    cache.view(heads, pages * page_size, dim).index_copy_(1, slot_mapping,
                                                         x.transpose(0, 1).to(cache.dtype))


def ref_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, hadamard: bool = False,
                 k_shift: torch.Tensor | None = None, k_divisor: torch.Tensor | None = None,
                 v_divisor: torch.Tensor | None = None) -> None:
    # k, v: [tokens, kv_heads, dim]; caches: [kv_heads, pages, page_size, dim]
    heads, _, _, dim = k_cache.shape
    assert k.shape == v.shape and k.shape[1:] == (heads, dim), (k.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],)
    ref_store_rows(k, k_cache, k_scale, slot_mapping, hadamard, k_shift, k_divisor)
    ref_store_rows(v, v_cache, v_scale, slot_mapping, hadamard, None, v_divisor)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, hadamard: bool = False,
             k_shift: torch.Tensor | None = None, k_divisor: torch.Tensor | None = None,
             v_divisor: torch.Tensor | None = None) -> None:
    """As `ref_store_kv`, through the `store_kv_rows` op (float32 K/V: the CPU kernels'
    input; other dtypes run the twin)."""
    if k.dtype != torch.float32:
        ref_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, hadamard,
                     k_shift, k_divisor, v_divisor)
        return
    ops = native_ops()
    ops.store_kv_rows(k, k_cache, slot_mapping, k_scale, hadamard, k_shift, k_divisor)
    ops.store_kv_rows(v, v_cache, slot_mapping, v_scale, hadamard, None, v_divisor)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scale: torch.Tensor | None = None) -> None:
    """MLA: write new tokens' latent vectors [tokens, 1, latent_dim] into latent pages
    [1, pages, page_size, row_width] (`kernels/latent.py`: float pages hold the latent as it is,
    through the `store_kv_rows` op for float32 latents; 1-byte pages the c_kv codes with one
    scale per token in `scale` and the RoPE part in bf16, written by the torch twin)."""
    assert latent.dim() == 3 and latent.shape[1] == 1 and cache.shape[0] == 1, (latent.shape,
                                                                                cache.shape)
    if is_quantized_kv(cache.dtype):
        ref_store_latent(latent, cache, slot_mapping, scale)
    elif latent.dtype != torch.float32:
        ref_store_rows(latent, cache, scale, slot_mapping, False)
    else:
        native_ops().store_kv_rows(latent, cache, slot_mapping, scale)
