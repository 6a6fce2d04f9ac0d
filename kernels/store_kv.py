"""Write new tokens' K and V into their page slots, in place."""

from __future__ import annotations

import torch


def ref_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    # k, v: [tokens, kv_heads, dim]; caches: [kv_heads, pages, page_size, dim]
    heads, pages, page_size, dim = k_cache.shape
    assert k.shape == v.shape and k.shape[1:] == (heads, dim), (k.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],)
    k_cache.view(heads, pages * page_size, dim).index_copy_(1, slot_mapping,
                                                             k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(heads, pages * page_size, dim).index_copy_(1, slot_mapping,
                                                             v.transpose(0, 1).to(v_cache.dtype))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    ref_store_kv(k, v, k_cache, v_cache, slot_mapping)
