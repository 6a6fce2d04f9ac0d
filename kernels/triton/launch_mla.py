"""Launcher for the Triton MLA decode kernel over tessera's latent pages: shape, dtype and
stride asserts, grid, split-K workspace.

The page layout is `runtime/kv/cache.py`'s: [1, pages, page_size, latent_dim] with one token's
normalised c_kv (kv_lora_rank values) then its roped k_pe, and for 1-byte pages one bf16 scale
per token over the whole row ([1, pages, page_size]). The RoPE part may instead come from its
own tensor (`rope_cache`, e.g. bf16 as FlashMLA keeps it) or carry its own scale
(`rope_scale`); see `mla_decode`. No launcher reads a device value, and the grid is a function
of (batch, heads, num_splits) only, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from typing import Any

import torch

MAX_SPLITS = 64
_QUANT = {torch.uint8: 1, torch.int8: 2}  # page storage dtype -> the kernel's *_QUANT code
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _jit() -> Any:
    from kernels.triton import mla_decode, paged_attention

    return mla_decode, paged_attention


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _codes(pages: torch.Tensor, scale: torch.Tensor | None, what: str) -> int:
    """The kernel's code for pages [1, pages, page_size, d] and their per-token scales."""
    assert pages.dim() == 4 and pages.shape[0] == 1 and pages.stride(-1) == 1, \
        f"{what}: [1, pages, page_size, dim] with contiguous rows, got {tuple(pages.shape)}"
    quant = _QUANT.get(pages.dtype, 0)
    if quant == 0:
        assert pages.dtype in _FLOATS, f"{what}: {pages.dtype} pages are not supported"
        assert scale is None, f"{what}: scales are for 1-byte pages"
        return 0
    # NOTE: never a silent scale of 1.0: a 1-byte page without its scales is a caller bug
    assert scale is not None, f"{what}: 1-byte pages need their per-token scales"
    assert scale.shape == pages.shape[:3] and scale.stride(-1) == 1, (scale.shape, pages.shape)
    return quant


def mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
               latent_scale: torch.Tensor | None = None,
               rope_cache: torch.Tensor | None = None, rope_scale: torch.Tensor | None = None,
               num_splits: int = 1, out: torch.Tensor | None = None,
               workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention of q [batch, heads, kv_lora_rank + rope] (q_nope absorbed through
    W_UK, then q_pe; bf16/fp16) over each sequence's first seq_lens[b] cached latents in pages
    block_table[b, :]; returns softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv,
    [batch, heads, kv_lora_rank] in q's dtype (into `out` when given: that shape and dtype,
    contiguous). W_UV and o_proj are the caller's.

    latent_cache [1, pages, page_size, dim]: bf16/fp16/fp32, e4m3 bytes (uint8) or int8, with
    latent_scale [1, pages, page_size] (bf16/fp32) for 1-byte pages; c_kv is its first
    kv_lora_rank columns (a power of two). The RoPE part k_pe is:
    - rope_cache None: the row's next `rope` columns, scaled by rope_scale when given, else
      by latent_scale (tessera's pages today: one scale over the whole row);
    - rope_cache [1, pages, page_size, rope] (any page/slot strides, e.g. a bf16 view of the
      row's tail): its own format, with rope_scale if it is 1-byte.
    block_table [batch, max_pages] int32/int64; seq_lens [batch] (0: a padded row, zeros).
    num_splits > 1: split-K with workspace (partials [batch, heads, num_splits, kv_lora_rank],
    lse [batch, heads, num_splits]) float32 contiguous, allocated here if not given.
    AssertionError on shapes, dtypes or strides.
    """
    mla, paged = _jit()
    assert q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16), (q.shape, q.dtype)
    assert q.stride(-1) == 1
    batch, num_heads, q_dim = q.shape
    lora, rope = kv_lora_rank, q_dim - kv_lora_rank
    assert lora == _next_pow2(lora) and lora >= 16 and rope > 0, (lora, q_dim)
    kv_quant = _codes(latent_cache, latent_scale, "latent_cache")
    page_size = latent_cache.shape[2]
    assert page_size % 16 == 0, f"page size must be a multiple of 16, got {page_size}"
    kv = latent_cache[0]
    if rope_cache is None:
        assert latent_cache.shape[3] == q_dim, (latent_cache.shape, q.shape)
        pe, pe_quant = kv[..., lora:], kv_quant
        pe_scale = rope_scale if rope_scale is not None else latent_scale
        assert rope_scale is None or rope_scale.shape == latent_cache.shape[:3]
    else:
        assert latent_cache.shape[3] >= lora and rope_cache.shape[:3] == latent_cache.shape[:3]
        assert rope_cache.shape[3] == rope, (rope_cache.shape, rope)
        pe_quant = _codes(rope_cache, rope_scale, "rope_cache")
        pe, pe_scale = rope_cache[0], rope_scale
    assert block_table.dim() == 2 and block_table.shape[0] == batch
    assert block_table.stride(-1) == 1 and block_table.dtype in (torch.int32, torch.int64)
    assert seq_lens.shape == (batch,), (seq_lens.shape, batch)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    if out is None:
        out = torch.empty(batch, num_heads, lora, dtype=q.dtype, device=q.device)
    assert out.shape == (batch, num_heads, lora) and out.dtype == q.dtype, (out.shape, out.dtype)
    assert out.is_contiguous()
    if batch == 0:
        return out
    splits = num_splits
    if splits > 1:
        if workspace is None:
            workspace = (torch.empty(batch, num_heads, splits, lora, dtype=torch.float32,
                                     device=q.device),
                         torch.empty(batch, num_heads, splits, dtype=torch.float32,
                                     device=q.device))
        part, lse = workspace
        assert part.shape == (batch, num_heads, splits, lora) and part.is_contiguous()
        assert lse.shape == (batch, num_heads, splits) and lse.is_contiguous()
        assert part.dtype == lse.dtype == torch.float32
        target, o_strides = part, part.stride()[:3]
    else:
        lse, target, o_strides = out, out, (*out.stride()[:2], 0)
    ks = latent_scale[0] if kv_quant else kv
    pes = pe_scale[0] if pe_quant else pe
    block_h = 16  # tl.dot's smallest M; SGLang caps it at 16 too (shared memory at 128 heads)
    grid = (batch, -(-num_heads // block_h), splits)
    mla.mla_decode_kernel[grid](
        target, lse, q, kv, pe, ks, pes, block_table, seq_lens,
        num_heads, float(scale), q.stride(0), q.stride(1),
        kv.stride(0), kv.stride(1), pe.stride(0), pe.stride(1),
        ks.stride(0) if kv_quant else 0, pes.stride(0) if pe_quant else 0,
        block_table.stride(0), *o_strides,
        LORA=lora, ROPE=rope, BLOCK_R=_next_pow2(rope), PAGE_SIZE=page_size,
        BLOCK_H=block_h, TILE_N=32 if kv_quant else 16, KV_QUANT=kv_quant, PE_QUANT=pe_quant,
        SPLIT=splits > 1, DOT_F32=_interpreted(), num_warps=4, num_stages=2,
    )
    if splits > 1:
        paged.merge_splits_kernel[(batch, num_heads)](
            out, part, lse, splits, num_heads, out.stride(0), out.stride(1),
            part.stride(0), part.stride(1), part.stride(2),
            HEAD_DIM=lora, BLOCK_D=lora, BLOCK_S=_next_pow2(splits), num_warps=4,
        )
    return out
