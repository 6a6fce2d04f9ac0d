"""MLA decode in Triton over latent pages: multi-query attention in the absorbed latent space
(DeepSeek-V3 / Kimi-K2: 512 latent + 64 RoPE dimensions, one latent vector per token).

SGLang's grouped decode kernel for MLA (`_fwd_grouped_kernel_stage1`, Lk 576 = 512 + 64): a
program holds BLOCK_H query heads of one sequence against one split of its context, a score
is q_latent . c_kv + q_pe . k_pe (two dots) and the value is c_kv itself. Unlike SGLang, the
c_kv tile is loaded once per step and used for both dots (scores through its transpose), and
the RoPE part may live apart from it (its own pointer, dtype and scale), so a page format can
keep it in bf16 or give it its own scale. Splits are merged by `merge_splits_kernel`
(`kernels/triton/paged_attention.py`). Launcher: `kernels/triton/launch_mla.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.paged_attention import _decode_tile, _dot, _page_slots, _split_range


@triton.jit
def mla_decode_kernel(
    out_ptr, lse_ptr, q_ptr, kv_ptr, pe_ptr, ks_ptr, pes_ptr,
    block_table_ptr, seq_lens_ptr,
    num_heads, sm_scale,
    stride_qb, stride_qh,
    stride_kp, stride_ko, stride_pp, stride_po, stride_sp, stride_psp,
    stride_bt, stride_ob, stride_oh, stride_os,
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr,
    KV_QUANT: tl.constexpr, PE_QUANT: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # grid: (batch, cdiv(heads, BLOCK_H), splits). KV_QUANT / PE_QUANT: 0 float codes, 1 e4m3
    # bytes, 2 int8, for c_kv and k_pe; a 1-byte part's per-token scale multiplies its scores
    # (and, for c_kv, the probabilities before P @ c_kv), never each element.
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_l = tl.arange(0, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROPE
    offs_n = tl.arange(0, TILE_N)
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_l[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows + LORA + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                   other=0.0)
    kv_lo, kv_hi = _split_range(seq_len, split, num_splits, TILE_N, SPLIT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + offs_n
        n_ok = pos < kv_hi
        page, slot = _page_slots(table, pos, n_ok, PAGE_SIZE)
        kv = tl.load(kv_ptr + (page * stride_kp + slot * stride_ko)[:, None] + offs_l[None, :],
                     mask=n_ok[:, None], other=0)
        kv = _decode_tile(kv, KV_QUANT, q.dtype)  # [TILE_N, LORA]: keys' latent part and values
        pe = tl.load(pe_ptr + (page * stride_pp + slot * stride_po)[None, :] + offs_r[:, None],
                     mask=n_ok[None, :] & r_ok[:, None], other=0)
        s = _dot(q, tl.trans(kv), DOT_F32)  # [BLOCK_H, TILE_N] fp32
        if KV_QUANT != 0:
            ks = tl.load(ks_ptr + page * stride_sp + slot, mask=n_ok, other=0.0).to(tl.float32)
            s = s * ks[None, :]
        s_pe = _dot(q_pe, _decode_tile(pe, PE_QUANT, q.dtype), DOT_F32)
        if PE_QUANT != 0:
            pes = tl.load(pes_ptr + page * stride_psp + slot, mask=n_ok, other=0.0)
            s_pe = s_pe * pes.to(tl.float32)[None, :]
        s = tl.where(n_ok[None, :], (s + s_pe) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT != 0:
            p = p * ks[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), kv, DOT_F32)
        m_i = m_new

    empty = l_i == 0.0  # no key: length 0 (a padded row) or an empty split
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
              + offs_l[None, :])
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, o, mask=h_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + (seq.to(tl.int64) * num_heads + heads) * num_splits + split, lse,
                 mask=h_ok)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
