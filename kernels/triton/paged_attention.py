"""Paged attention in Triton: one kernel for decode and chunked prefill/extend over a paged
prefix, with an optional split-K (flash-decoding) mode and the kernel that merges its splits.

The layout is tessera's (`runtime/kv/cache.py`): K and V pages [kv_heads, pages, page_size,
dim], scales [kv_heads, pages, page_size] bf16 for the 1-byte formats, one block table row per
sequence. The 1-byte formats' rotation and smoothing run inside the kernels: queries scaled
per channel and rotated in the prologue, the output rotated back and scaled in the epilogue
(or in the merge, for split-K), with the store's butterfly (`store_kv._fwht`), in fp32 as the
torch twin does them. Launchers, grids and asserts: `kernels/triton/launch.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.store_kv import _bf16_bits, _fwht


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 -> `dtype`, rounded to nearest even (bf16 through its bits: triton 3.9's
    interpreter truncates fp32 -> bf16 casts)."""
    if dtype == tl.bfloat16:
        return _bf16_bits(x).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rotate_back(o, os_row, inv_sqrt_dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                 LOG2_D: tl.constexpr, ROTATE: tl.constexpr, O_SCALE: tl.constexpr):
    """o [ROWS, BLOCK_D] fp32 -> o H (ROTATE), times the output's per-channel scale `os_row`
    [BLOCK_D] (O_SCALE): the twin's `fwht(out)` then `_per_kv_head(out, out_scale)`."""
    if ROTATE:
        o = _fwht(o, inv_sqrt_dim, ROWS, BLOCK_D, LOG2_D)
    if O_SCALE:
        o = o * os_row[None, :]
    return o


@triton.jit
def _find_seq(cu_q_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain `block_idx`: sequence s owns the blocks from
    cu_q[s] // BLOCK_Q + s (an upper bound that needs no host sync, vLLM's unified kernel)."""
    lo = tl.zeros([], tl.int32)
    hi = num_seqs + lo
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _decode_tile(x, KV_QUANT: tl.constexpr, dtype: tl.constexpr):
    """Page codes -> `dtype` (bf16 / fp16), unscaled; e4m3 and int8 codes convert exactly."""
    if KV_QUANT == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    elif KV_QUANT == 2:
        x = x.to(tl.float32)  # int8 -> bf16 directly is wrong in triton 3.9's interpreter
    return x.to(dtype)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with fp32 accumulation. DOT_F32 (the interpreter, and fp32 queries): the same
    products and sums from operands widened to fp32 in IEEE precision (no tf32), because
    triton 3.9's interpreter multiplies bf16 operands' raw bits (bf16 x bf16 products are
    exact in fp32, so the result is the same)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _split_range(kv_end, split, num_splits, TILE_N: tl.constexpr, SPLIT: tl.constexpr):
    """Keys [kv_lo, kv_hi) of this split of [0, kv_end): whole tiles, sized from the length (so
    a sequence's splits follow its own length), the last ones possibly empty."""
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_lo + split_len, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end
    return kv_lo, kv_hi


@triton.jit
def _page_slots(table, pos, n_ok, PAGE_SIZE: tl.constexpr):
    """(page id, slot in page) of token positions `pos` through a block-table row, int64."""
    # NOTE: int64 before any stride product: page * stride overflows int32 in big pools
    page = tl.load(table + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    return page, (pos % PAGE_SIZE).to(tl.int64)


@triton.jit
def paged_attention_kernel(
    out_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    block_table_ptr, seq_lens_ptr, cu_q_ptr, valid_ptr, qs_ptr, os_ptr,
    num_seqs, num_heads, sm_scale, inv_sqrt_dim,
    stride_qt, stride_qh,
    stride_kh, stride_kp, stride_ko,
    stride_vh, stride_vp, stride_vo,
    stride_sh, stride_sp,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, KV_QUANT: tl.constexpr, HAS_VALID: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    ROTATE: tl.constexpr, Q_SCALE: tl.constexpr, O_SCALE: tl.constexpr, LOG2_D: tl.constexpr,
):
    # grid: (q blocks upper bound, kv_heads, splits). Rows of a program: BLOCK_Q query tokens
    # x GROUP query heads of one KV head (GQA packed into M). KV_QUANT: 0 bf16/fp16 pages,
    # 1 e4m3 bytes, 2 int8; 1-byte pages apply the K scale to S and the V scale to P.
    # Q_SCALE / ROTATE: q times qs [kv_heads, HEAD_DIM], then q H, in fp32, rounded back to
    # q's dtype; ROTATE / O_SCALE: the output rotated back and times os [kv_heads, HEAD_DIM]
    # (here, or in merge_splits_kernel for split-K partials).
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = _find_seq(cu_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    if HAS_VALID:  # a sequence the tag pass failed reads no KV at all (fail-closed)
        seq_len = tl.where(tl.load(valid_ptr + seq) != 0, seq_len, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    q_tok = local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (q_tok < q_len) & (offs_m < BLOCK_Q * GROUP)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROTATE or Q_SCALE:
        qf = q.to(tl.float32)
        if Q_SCALE:
            qf = qf * tl.load(qs_ptr + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)[None, :]
        if ROTATE:
            qf = _fwht(qf, inv_sqrt_dim, BLOCK_M, BLOCK_D, LOG2_D)
        q = _round_to(qf, q_ptr.dtype.element_ty)
    prefix = seq_len - q_len  # cached tokens before this chunk: causal with that offset
    q_pos = prefix + q_tok
    kv_end = tl.minimum(seq_len, prefix + tl.minimum((local + 1) * BLOCK_Q, q_len))
    kv_lo, kv_hi = _split_range(kv_end, split, num_splits, TILE_N, SPLIT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + offs_n
        n_ok = pos < kv_hi
        page, slot = _page_slots(table, pos, n_ok, PAGE_SIZE)
        k = tl.load(k_base + (page * stride_kp + slot * stride_ko)[None, :] + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0)
        s = _dot(q, _decode_tile(k, KV_QUANT, q.dtype), DOT_F32)  # [BLOCK_M, TILE_N] fp32
        if KV_QUANT != 0:
            ks = tl.load(ks_ptr + kv_head.to(tl.int64) * stride_sh + page * stride_sp + slot,
                         mask=n_ok, other=0.0).to(tl.float32)
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(n_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT != 0:
            vs = tl.load(vs_ptr + kv_head.to(tl.int64) * stride_sh + page * stride_sp + slot,
                         mask=n_ok, other=0.0).to(tl.float32)
            p = p * vs[None, :]
        v = tl.load(v_base + (page * stride_vp + slot * stride_vo)[:, None] + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0)
        v = _decode_tile(v, KV_QUANT, q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_F32)
        m_i = m_new

    empty = l_i == 0.0  # no visible key (length 0, an invalid sequence, an empty split)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, o, mask=o_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + (q_row * num_heads + head) * num_splits + split, lse, mask=row_ok)
    else:
        if ROTATE or O_SCALE:
            os_row = tl.load(os_ptr + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
            o = _rotate_back(o, os_row, inv_sqrt_dim, BLOCK_M, BLOCK_D, LOG2_D, ROTATE, O_SCALE)
        tl.store(o_ptrs, _round_to(o, out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def merge_splits_kernel(
    out_ptr, part_ptr, lse_ptr, os_ptr, num_splits, num_heads, inv_sqrt_dim,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr, ROTATE: tl.constexpr, O_SCALE: tl.constexpr, LOG2_D: tl.constexpr,
):
    # grid: (tokens, heads). Each split's normalized partial is weighted by exp2(its lse - max);
    # then the attention kernel's epilogue (rotation back, output scale of head // GROUP).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + (tok * num_heads + head) * num_splits + offs_s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    parts = tl.load(part_ptr + tok * stride_pt + head * stride_ph
                    + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    if ROTATE or O_SCALE:
        os_row = tl.load(os_ptr + (head // GROUP) * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        o = tl.reshape(_rotate_back(tl.reshape(o, [1, BLOCK_D]), os_row, inv_sqrt_dim, 1,
                                    BLOCK_D, LOG2_D, ROTATE, O_SCALE), [BLOCK_D])
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d,
             _round_to(o, out_ptr.dtype.element_ty), mask=d_ok)
