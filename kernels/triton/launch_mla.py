"""Launchers for the Triton MLA kernels over tessera's latent pages: shape, dtype and stride
asserts, grids, split-K workspace.

The page layout is `kernels/latent.py`'s: [1, pages, page_size, row_width], one token's
normalised c_kv (kv_lora_rank values) then its roped k_pe; 1-byte rows hold c_kv codes with one
bf16 scale per token ([1, pages, page_size]) and the k_pe part as bf16 bytes (FlashMLA's
format), which `mla_decode` reads through `rope_cache` (a bf16 view of the row's tail).
`mla_decode` also takes a RoPE part under the row's scale or with a scale of its own (the
layouts measured before choosing this one). `store_latent` writes the row; `mla_attention` is
the varlen form the `triton` backend runs. No launcher reads a device value, and the grids
are functions of shapes and num_splits only, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.latent import latent_split, rope_view
from kernels.triton.launch import (
    _FLOAT_PAGES,
    _QUANT,
    MAX_SPLITS,
    _interpreted,
    _next_pow2,
    merge_splits,
    split_targets,
)


def _jit() -> Any:
    from kernels.triton import mla_decode, store_kv

    return mla_decode, store_kv


def _codes(pages: torch.Tensor, scale: torch.Tensor | None, what: str) -> int:
    """The kernel's code for pages [1, pages, page_size, d] and their per-token scales."""
    assert pages.dim() == 4 and pages.shape[0] == 1 and pages.stride(-1) == 1, \
        f"{what}: [1, pages, page_size, dim] with contiguous rows, got {tuple(pages.shape)}"
    quant = _QUANT.get(pages.dtype, 0)
    if quant == 0:
        assert pages.dtype in _FLOAT_PAGES, f"{what}: {pages.dtype} pages are not supported"
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
    W_UK, then q_pe; bf16/fp16/fp32, fp32 with IEEE products) over each sequence's first
    seq_lens[b] cached latents in pages block_table[b, :]; returns
    softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv,
    [batch, heads, kv_lora_rank] in q's dtype (into `out` when given: that shape and dtype,
    contiguous). W_UV and o_proj are the caller's.

    latent_cache [1, pages, page_size, dim]: bf16/fp16/fp32, e4m3 bytes (uint8) or int8, with
    latent_scale [1, pages, page_size] (bf16/fp32) for 1-byte pages; c_kv is its first
    kv_lora_rank columns (a power of two). The RoPE part k_pe is:
    - rope_cache None: the row's next `rope` columns, scaled by rope_scale when given, else
      by latent_scale (float pages; 1-byte rows under one scale, measured, not used);
    - rope_cache [1, pages, page_size, rope] (any page/slot strides, e.g. the bf16 view of the
      row's tail that tessera's 1-byte pages hold): its own format, with rope_scale if it is
      1-byte.
    block_table [batch, max_pages] int32/int64; seq_lens [batch] (0: a padded row, zeros).
    num_splits > 1: split-K with workspace (partials [batch, heads, num_splits, kv_lora_rank],
    lse [batch, heads, num_splits]) float32 contiguous, allocated here if not given.
    AssertionError on shapes, dtypes or strides.
    """
    mla = _jit()[0]
    assert q.dim() == 3 and q.dtype in _FLOAT_PAGES, (q.shape, q.dtype)
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
    target, lse, o_strides = split_targets(out, splits, workspace)
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
        SPLIT=splits > 1, DOT_F32=_interpreted() or q.dtype == torch.float32, num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        merge_splits(out, target, lse)
    return out


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scale: torch.Tensor | None = None) -> None:
    """`kernels.store_kv.store_latent` in one launch, in place, bit for bit its result:
    latent [tokens, 1, kv_lora_rank + rope] (bf16/fp16/fp32, any token stride) into latent
    pages [1, pages, page_size, row_width] at slot_mapping [tokens] (-1 writes nothing); 1-byte
    pages (`kernels/latent.py`'s row) take scale [1, pages, page_size] bf16. kv_lora_rank and
    rope must be powers of two (512 and 64 for DeepSeek-V3)."""
    store = _jit()[1]
    assert latent.dim() == 3 and latent.shape[1] == 1 and latent.stride(-1) == 1, latent.shape
    assert cache.dim() == 4 and cache.shape[0] == 1 and cache.is_contiguous(), cache.shape
    tokens, _, dim = latent.shape
    page_size, width = cache.shape[2], cache.shape[3]
    quant = _QUANT.get(cache.dtype, 0)
    lora, rope = latent_split(width, dim, cache.dtype)
    if quant == 0:
        assert scale is None, "scales are for 1-byte pages"
        # a plain copy: any cut into two power-of-two parts will do (576 = 512 + 64)
        lora = 1 << (dim.bit_length() - 1)
        rope = dim - lora
        pe = cache[..., lora:]
    else:
        assert scale is not None and scale.shape == cache.shape[:3] and scale.is_contiguous()
        pe = rope_view(cache, lora)
    assert rope > 0 and lora == _next_pow2(lora) and rope == _next_pow2(rope), (lora, rope)
    assert slot_mapping.shape == (tokens,), (slot_mapping.shape, tokens)
    if tokens == 0:
        return
    # NOTE: bf16 scales are written as their bit patterns (see store_kv.py's _bf16_bits)
    sc = scale.view(torch.uint16) if scale is not None else cache
    block_t = min(16, _next_pow2(tokens))
    store.store_latent_kernel[(-(-tokens // block_t),)](
        latent, cache, pe, sc, slot_mapping, tokens, latent.stride(0),
        cache.stride(1), cache.stride(2), pe.stride(1), pe.stride(2),
        sc.stride(1) if quant else 0,
        PAGE_SIZE=page_size, LORA=lora, ROPE=rope, QUANT=quant, BLOCK_T=block_t,
        num_warps=4 if block_t > 4 else 1,
    )


def mla_attention(q: torch.Tensor, latent_cache: torch.Tensor,
                  latent_scale: torch.Tensor | None, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                  kv_lora_rank: int, num_splits: int = 1,
                  max_seqlen_q: int | None = None) -> torch.Tensor:
    """Varlen MLA over tessera's latent pages, as `launch.paged_attention` is for K/V: sequence
    s has queries q[cu_seqlens_q[s]:cu_seqlens_q[s+1]], the last of its seq_lens[s] tokens
    (causal with that offset), in pages block_table[s, :]. q [T, heads, latent_dim];
    latent_cache [1, pages, page_size, row_width] in `kernels/latent.py`'s row (1-byte rows:
    c_kv codes with latent_scale [1, pages, page_size], the RoPE part read as its bf16 view).
    Returns [T, heads, kv_lora_rank] in q's dtype.

    Every query token is one row of `mla_decode` over its own causal context, as the CPU path
    runs a prefill chunk through its decode kernel: one kernel for decode, prefill and extend,
    reading the pages in place (no dequantized copy). A prefill re-reads its context per
    token, which a q-blocked MLA prefill kernel would not; that is the follow-up for long
    prompts. The rows come from device tensors (no host sync)."""
    tokens, seqs = q.shape[0], block_table.shape[0]
    assert cu_seqlens_q.shape == (seqs + 1,) and seq_lens.shape == (seqs,)
    if (max_seqlen_q == 1 if max_seqlen_q is not None else tokens == seqs):
        table, lens = block_table, seq_lens
    else:
        ends = cu_seqlens_q[1:].long()
        q_lens = ends - cu_seqlens_q[:-1].long()
        seq_of = torch.repeat_interleave(torch.arange(seqs, device=q.device), q_lens,
                                         output_size=tokens)
        position = torch.arange(tokens, device=q.device)
        lens = seq_lens.long()[seq_of] - (ends[seq_of] - 1 - position)
        table = block_table.index_select(0, seq_of)
    rope_cache = None
    if _QUANT.get(latent_cache.dtype, 0):
        rope_cache = rope_view(latent_cache, kv_lora_rank)
    return mla_decode(q, latent_cache, table.contiguous(), lens, scale, kv_lora_rank,
                      latent_scale, rope_cache, num_splits=num_splits)
