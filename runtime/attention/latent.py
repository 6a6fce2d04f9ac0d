"""MLA over latent pages for the backends that run per-sequence groups (`cpu`, `torch`): the
latent store and multi-query attention in the latent space through the paged-attention ops.

Float latent pages are read by the ops as they are (one "KV head" of latent_dim, values = the
whole row, the RoPE columns of the output dropped). 1-byte pages hold FlashMLA's row (c_kv
codes + one scale, RoPE part in bf16: `kernels/latent.py`), which the ops' one-scale-per-row
kernels cannot read: the pages this step touches are dequantized once per layer into float
pages (a pure function of each row, so batch invariance holds) and the ops run over those.
"""

from __future__ import annotations

import torch

from kernels import (
    dequantize_latent_pages,
    is_quantized_kv,
    paged_decode_attention,
    paged_prefill_attention,
    store_latent,
)
from runtime.context import AttentionMetadata
from runtime.kv.cache import LayerKV


def store_latent_rows(meta: AttentionMetadata, kv: LayerKV, latent: torch.Tensor) -> None:
    """latent [T, 1, latent_dim] into the layer's latent pages at `meta.slot_mapping`."""
    store_latent(latent, kv.k, meta.slot_mapping, kv.k_scale)


def attend_latent_groups(meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """q [T, heads, latent_dim] (q_nope absorbed, then q_pe) over the step's groups ->
    [T, heads, kv_lora_rank]: softmax(scale * q . latent) @ c_kv."""
    pages, page_scale = kv.k, kv.k_scale
    tables = [g.page_table for g in meta.decodes] + [p.page_ids for p in meta.prefills]
    if is_quantized_kv(pages.dtype):
        assert page_scale is not None, "1-byte latent pages need their scales"
        used = torch.unique(torch.cat([t.reshape(-1) for t in tables]))
        pages = dequantize_latent_pages(pages, page_scale, q.shape[-1], used, q.dtype)
        page_scale = None
        tables = [torch.searchsorted(used, t) for t in tables]
    parts = []
    for g, table in zip(meta.decodes, tables, strict=False):
        parts.append(paged_decode_attention(q[g.start : g.end], pages, pages, table,
                                            g.context_lens, scale, page_scale, page_scale))
    for p, table in zip(meta.prefills, tables[len(meta.decodes):], strict=True):
        parts.append(paged_prefill_attention(q[p.start : p.end], pages, pages, table,
                                             p.context_len, p.mask, scale, page_scale,
                                             page_scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out.view(q.shape)[..., :kv_lora_rank]
