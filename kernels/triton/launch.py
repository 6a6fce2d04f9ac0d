"""Launchers for the Triton paged-KV kernels: shape, dtype and stride asserts, grids, configs.

Signatures follow the torch twins (`kernels/paged_attention.py`, `kernels/store_kv.py`,
`kernels/verify_pages.py`) so each can be registered as the CUDA implementation of the same
`tessera` op; `paged_attention` is the varlen form both decode and prefill are built on. No
launcher reads a device value (no host sync), and every grid is a function of tensor shapes
and `num_splits` only, so a decode step can be captured in a CUDA graph per batch bucket.
triton is imported on first launch, never at import time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kernels.hadamard import kv_rotation_applies

MAX_SPLITS = 64
_QUANT = {torch.uint8: 1, torch.int8: 2}  # page storage dtype -> kernel KV_QUANT code
_FLOAT_PAGES = (torch.bfloat16, torch.float16, torch.float32)
_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _jit() -> Any:
    from kernels.triton import paged_attention, store_kv, verify_pages

    return paged_attention, store_kv, verify_pages


def _interpreted() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1), whose bf16 tl.dot is
    wrong in triton 3.9 (see `_dot` in paged_attention.py)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Split-K count for a decode batch bucket: enough (query block, KV head, split) programs
    for ~4 per SM, a power of two in [1, 16]. It depends on the bucket only (never on context
    lengths), so one CUDA graph per bucket holds; each sequence's splits are then sized from
    its own length inside the kernel."""
    programs = max(1, batch * num_kv_heads)
    want = -(-4 * num_sms // programs)
    return min(16, _next_pow2(want)) if want > 1 else 1


def decode_tile_n(one_byte_pages: bool) -> int:
    """Keys a decode program reads per inner step: 128 for 1-byte pages, 64 for 2-byte ones
    (16 KiB of K and V either way). Measured on an H200 (ops/bench/RESULTS.md, GPU check):
    64 x 8192 tokens of Llama-8B-shaped attention, bf16 at 97% of the copy bandwidth against
    73% with 32 keys, fp8 47% against 31% with 64; 8 warps or a third stage was no faster."""
    return 128 if one_byte_pages else 64


def _kv_format(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> int:
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "page rows must be contiguous"
    assert k_cache.stride()[1:] == v_cache.stride()[1:], "K and V pages share one layout"
    quant = _QUANT.get(k_cache.dtype, 0)
    if quant == 0:
        assert k_cache.dtype in _FLOAT_PAGES, f"{k_cache.dtype} pages are not supported"
        assert k_scale is None and v_scale is None, "scales are for 1-byte pages"
        return 0
    # NOTE: never a silent scale of 1.0: a 1-byte page without its scales is a caller bug
    assert k_scale is not None and v_scale is not None, "1-byte pages need k_scale and v_scale"
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3], (k_scale.shape, k_cache.shape)
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    return quant


def split_targets(out: torch.Tensor, splits: int,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Where an attention kernel writes for out [rows, heads, dim]: (target, lse, the target's
    (row, head, split) strides). One split: out itself (lse unused). Split-K: partials [rows,
    heads, splits, dim] and their log-sum-exps [rows, heads, splits], float32 contiguous, from
    `workspace` (checked; CUDA graphs pass preallocated ones) or new; `merge_splits` them."""
    if splits == 1:
        return out, out, (*out.stride()[:2], 0)
    rows, heads, dim = out.shape
    if workspace is None:
        workspace = (torch.empty(rows, heads, splits, dim, dtype=torch.float32,
                                 device=out.device),
                     torch.empty(rows, heads, splits, dtype=torch.float32, device=out.device))
    part, lse = workspace
    assert part.shape == (rows, heads, splits, dim) and part.is_contiguous()
    assert lse.shape == (rows, heads, splits) and lse.is_contiguous()
    assert part.dtype == lse.dtype == torch.float32
    return part, lse, part.stride()[:3]


def merge_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor,
                 epilogue: _Epilogue | None = None) -> None:
    """out [rows, heads, dim] (any row and head strides) = the split-K partials merged by their
    log-sum-exps (`split_targets`' tensors), in split order; then `epilogue` (the rotation back
    and output scale of the attention kernel's 1-byte pages), where given."""
    rows, heads, splits, dim = part.shape
    ep = epilogue or _Epilogue.none(out)
    _jit()[0].merge_splits_kernel[(rows, heads)](
        out, part, lse, ep.out_scale, splits, heads, ep.inv_sqrt_dim, out.stride(0),
        out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        HEAD_DIM=dim, BLOCK_D=_next_pow2(dim), BLOCK_S=_next_pow2(splits), GROUP=ep.group,
        ROTATE=ep.rotate, O_SCALE=ep.has_out_scale, LOG2_D=ep.log2_dim, num_warps=4,
    )


@dataclass(frozen=True)
class _Epilogue:
    """What the attention kernels do to queries before and to the output after attending:
    per-channel scales (smoothing) and the Hadamard rotation of rotated 1-byte pages."""

    rotate: bool
    q_scale: torch.Tensor  # [kv_heads, dim] float32 (a placeholder where unused)
    out_scale: torch.Tensor
    has_q_scale: bool
    has_out_scale: bool
    group: int
    dim: int

    @property
    def inv_sqrt_dim(self) -> float:
        return 1.0 / math.sqrt(self.dim)

    @property
    def log2_dim(self) -> int:
        return max(0, self.dim.bit_length() - 1)

    @classmethod
    def none(cls, like: torch.Tensor) -> _Epilogue:
        return cls(False, like, like, False, False, 1, like.shape[-1])

    @classmethod
    def of(cls, rotate: bool, q_scale: torch.Tensor | None, out_scale: torch.Tensor | None,
           kv_heads: int, group: int, dim: int, like: torch.Tensor) -> _Epilogue:
        scales = []
        for t in (q_scale, out_scale):
            if t is not None:
                assert t.shape == (kv_heads, dim), (t.shape, kv_heads, dim)
                t = t.to(device=like.device, dtype=torch.float32).contiguous()
            scales.append(t)
        qs, os_ = scales
        return cls(rotate, qs if qs is not None else like, os_ if os_ is not None else like,
                   qs is not None, os_ is not None, group, dim)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    hadamard: bool = False, q_scale: torch.Tensor | None = None,
                    out_scale: torch.Tensor | None = None, num_splits: int = 1,
                    seq_valid: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    tile_n: int | None = None, out_dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                    num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Varlen paged attention: sequence s has queries q[cu_seqlens_q[s]:cu_seqlens_q[s+1]],
    the last of its seq_lens[s] tokens (its cached prefix, then this chunk; causal with that
    offset), whose KV lives in the pages block_table[s, :]. Decode is q_len 1.

    q: [T, heads, dim] bf16/fp16/fp32 (fp32: IEEE fp32 products, no tf32); k_cache, v_cache:
    [kv_heads, pages, page_size, dim] bf16, fp16, fp32, uint8 (e4m3 bytes) or int8, with
    k_scale, v_scale [kv_heads, pages, page_size] bf16 for the 1-byte formats; block_table: [S,
    max_pages] int32/int64; seq_lens: [S]; cu_seqlens_q: [S + 1] int32/int64; seq_valid: [S] (0:
    read no KV, output zeros) or None. hadamard / q_scale / out_scale: the rotation and
    smoothing of `ref_paged_decode_attention`, applied the same way (queries scaled and rotated
    before, output rotated back and scaled after the kernel). num_splits > 1: split-K, partials
    with their log-sum-exp then a merge.
    Returns [T, heads * dim] in out_dtype (default q's dtype), written into `out` when given
    (contiguous, that shape and dtype). workspace: (partials [T, heads, num_splits, dim],
    lse [T, heads, num_splits]) float32 contiguous for split-K, else allocated here (CUDA
    graphs pass preallocated ones). tile_n (keys per inner step; default `decode_tile_n` for
    decode, 32 or 64 otherwise), num_warps, num_stages: the launch config.
    AssertionError on shapes, dtypes or strides.
    """
    paged = _jit()[0]
    assert q.dim() == 3 and q.dtype in _QUERY_DTYPES, (q.shape, q.dtype)
    tokens, num_heads, dim = q.shape
    quant = _kv_format(k_cache, v_cache, k_scale, v_scale)
    kv_heads, _, page_size, cache_dim = k_cache.shape
    assert cache_dim == dim and num_heads % kv_heads == 0, (q.shape, k_cache.shape)
    assert page_size % 16 == 0, f"page size must be a multiple of 16, got {page_size}"
    num_seqs = block_table.shape[0]
    assert block_table.dim() == 2 and block_table.stride(-1) == 1
    assert block_table.dtype in (torch.int32, torch.int64)
    assert seq_lens.shape == (num_seqs,) and cu_seqlens_q.shape == (num_seqs + 1,)
    assert seq_valid is None or seq_valid.shape == (num_seqs,)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    rotated = hadamard and quant != 0
    assert not rotated or kv_rotation_applies(dim), f"no rotation for head size {dim}"
    group = num_heads // kv_heads
    q_dtype = q.dtype
    out_dtype = out_dtype or q_dtype
    ep = _Epilogue.of(rotated, q_scale, out_scale, kv_heads, group, dim, q)
    assert q.stride(-1) == 1
    decode = max_seqlen_q == 1 if max_seqlen_q is not None else tokens == num_seqs
    block_m = max(16, _next_pow2(group)) if decode else max(64, _next_pow2(group))
    block_q = block_m // group
    tile = tile_n or (decode_tile_n(quant != 0) if decode else (64 if quant else 32))
    if out is not None:
        assert out.shape == (tokens, num_heads * dim) and out.dtype == out_dtype, \
            (out.shape, out.dtype, tokens, num_heads * dim, out_dtype)
        assert out.is_contiguous()
    else:
        out = torch.empty(tokens, num_heads * dim, dtype=out_dtype, device=q.device)
    out3 = out.view(tokens, num_heads, dim)
    splits = num_splits
    target, lse, o_strides = split_targets(out3, splits, workspace)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    grid = (tokens // block_q + num_seqs, kv_heads, splits)
    paged.paged_attention_kernel[grid](
        target, lse, q, k_cache, v_cache, ks, vs, block_table, seq_lens, cu_seqlens_q,
        seq_valid if seq_valid is not None else seq_lens, ep.q_scale, ep.out_scale,
        num_seqs, num_heads, float(scale), ep.inv_sqrt_dim,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        block_table.stride(0), *o_strides,
        GROUP=group, HEAD_DIM=dim, BLOCK_D=_next_pow2(dim), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile, KV_QUANT=quant,
        HAS_VALID=seq_valid is not None, SPLIT=splits > 1,
        DOT_F32=_interpreted() or q_dtype == torch.float32,
        ROTATE=ep.rotate, Q_SCALE=ep.has_q_scale, O_SCALE=ep.has_out_scale,
        LOG2_D=ep.log2_dim, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        merge_splits(out3, target, lse, ep)
    return out



def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, hadamard: bool = False,
                           q_scale: torch.Tensor | None = None,
                           out_scale: torch.Tensor | None = None, num_splits: int = 1,
                           seq_valid: torch.Tensor | None = None) -> torch.Tensor:
    """`ref_paged_decode_attention`'s signature (q: [batch, heads, dim], one token each;
    page_table: [batch, max_pages]; context_lens: [batch]) -> [batch, heads * dim], plus the
    split count and the tag pass's valid flags."""
    batch = q.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, k_cache, v_cache, page_table, context_lens, cu, scale, k_scale,
                           v_scale, hadamard, q_scale, out_scale, num_splits, seq_valid,
                           max_seqlen_q=1)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_ids: torch.Tensor, context_len: int, mask: torch.Tensor | None,
                            scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, hadamard: bool = False,
                            q_scale: torch.Tensor | None = None,
                            out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`ref_paged_prefill_attention`'s signature for one sequence's chunk (q: [chunk, heads,
    dim], keys its first context_len cached tokens) -> [chunk, heads * dim]. `mask` must be
    None or the model runner's causal-with-offset mask [chunk, context_len] (query i at
    position context_len - chunk + i), which the kernel applies itself; other masks are not
    supported (its values are not read: no host sync)."""
    chunk = q.shape[0]
    assert mask is None or mask.shape == (chunk, context_len), (mask.shape, chunk, context_len)
    assert chunk <= context_len, (chunk, context_len)
    lens = torch.tensor([context_len], dtype=torch.int32, device=q.device)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=q.device)
    table = page_ids.reshape(1, -1).contiguous()
    return paged_attention(q, k_cache, v_cache, table, lens, cu, scale, k_scale, v_scale,
                           hadamard, q_scale, out_scale, max_seqlen_q=chunk)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, hadamard: bool = False,
             k_shift: torch.Tensor | None = None, k_divisor: torch.Tensor | None = None,
             v_divisor: torch.Tensor | None = None) -> None:
    """`ref_store_kv` in one launch, in place, bit for bit its result: k, v [tokens, kv_heads,
    dim] (bf16/fp16/fp32, any token and head strides); caches [kv_heads, pages, page_size,
    dim]; slot_mapping [tokens] (page * page_size + offset; -1 writes nothing); 1-byte pages
    take k_scale / v_scale [kv_heads, pages, page_size] bf16 and optional smoothing
    k_shift, k_divisor, v_divisor [kv_heads, dim] float32."""
    _kv_format(k_cache, v_cache, k_scale, v_scale)
    assert v.shape == k.shape and v.stride(-1) == 1, (k.shape, v.shape)
    _store(k, k_cache, k_scale, slot_mapping, hadamard, k_shift, k_divisor, (v, v_cache,
                                                                            v_scale, v_divisor))


def store_rows(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
               scale: torch.Tensor | None = None, hadamard: bool = False,
               shift: torch.Tensor | None = None, divisor: torch.Tensor | None = None) -> None:
    """`ref_store_rows` (the `store_kv_rows` op) for one cache, as `store_kv` does each of K
    and V: x [tokens, heads, dim] into cache [heads, pages, page_size, dim] at slot_mapping."""
    _kv_format(cache, cache, scale, scale)
    _store(x, cache, scale, slot_mapping, hadamard, shift, divisor, None)


def _store(k: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
           slot_mapping: torch.Tensor, hadamard: bool, k_shift: torch.Tensor | None,
           k_divisor: torch.Tensor | None,
           values: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor | None] | None) -> None:
    store = _jit()[1]
    v, v_cache, v_scale, v_divisor = values if values is not None else (k, k_cache, k_scale,
                                                                         None)
    quant = _QUANT.get(k_cache.dtype, 0)
    heads, _, page_size, dim = k_cache.shape
    tokens = k.shape[0]
    assert k.shape == (tokens, heads, dim), (k.shape, k_cache.shape)
    assert k.stride(-1) == 1
    assert slot_mapping.shape == (tokens,), (slot_mapping.shape, tokens)
    if quant == 0:
        assert k_shift is None and k_divisor is None and v_divisor is None, \
            "smoothing is for quantized pages"
    assert kv_rotation_applies(dim), f"head size {dim} is not a power of two"
    for t in (k_shift, k_divisor, v_divisor):
        assert t is None or (t.shape == (heads, dim) and t.dtype == torch.float32
                             and t.is_contiguous()), "smoothing factors: [kv_heads, dim] fp32"
    if tokens == 0:
        return
    # NOTE: bf16 scales are written as their bit patterns (see _bf16_bits)
    ks = k_scale.view(torch.uint16) if k_scale is not None else k_cache
    vs = v_scale.view(torch.uint16) if v_scale is not None else v_cache
    dummy = slot_mapping
    block_t = min(16, _next_pow2(tokens))
    store.store_kv_kernel[(-(-tokens // block_t), heads)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k_shift if k_shift is not None else dummy, k_divisor if k_divisor is not None else dummy,
        v_divisor if v_divisor is not None else dummy, 1.0 / math.sqrt(dim), tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        PAGE_SIZE=page_size, DIM=dim, LOG2_DIM=dim.bit_length() - 1, QUANT=quant,
        ROTATE=hadamard and quant != 0, HAS_SHIFT=k_shift is not None,
        HAS_DIVISOR=k_divisor is not None, HAS_V_DIVISOR=v_divisor is not None,
        HAS_V=values is not None, BLOCK_T=block_t, num_warps=4 if block_t > 4 else 1,
    )


def verify_pages(page_table: torch.Tensor, expected_page_ids: torch.Tensor,
                 expected_tags: torch.Tensor, expected_owners: torch.Tensor,
                 num_entries: torch.Tensor, pool_tags: torch.Tensor, pool_owners: torch.Tensor,
                 pool_refcounts: torch.Tensor, block: int = 512
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tag check for a batch on the device: sequence s's first num_entries[s] entries of
    page_table (what attention reads) against what it recorded, each decided as
    `ref_verify_pages` decides. page_table, expected_*: [S, max_pages] (int32/int64);
    num_entries: [S]; pool_*: [num_pages] int64. Returns (valid [S] int32: 1 iff every entry is
    OK, cause [S] int32: the first bad entry's code from kernels/verify_pages.py, 0 if none).
    Pass `valid` to `paged_attention(seq_valid=...)`: a failed sequence reads no KV."""
    tags_kernel = _jit()[2]
    seqs = page_table.shape[0]
    for t in (expected_page_ids, expected_tags, expected_owners):
        assert t.shape == page_table.shape and t.stride(-1) == 1, (t.shape, page_table.shape)
    assert page_table.stride(-1) == 1 and num_entries.shape == (seqs,)
    num_pages = pool_tags.shape[0]
    assert pool_owners.shape == pool_refcounts.shape == (num_pages,)
    assert pool_tags.dtype == pool_owners.dtype == pool_refcounts.dtype == torch.int64
    valid = torch.empty(seqs, dtype=torch.int32, device=page_table.device)
    cause = torch.empty(seqs, dtype=torch.int32, device=page_table.device)
    if seqs:
        tags_kernel.verify_pages_kernel[(seqs,)](
            valid, cause, page_table, expected_page_ids, expected_tags, expected_owners,
            num_entries, pool_tags, pool_owners, pool_refcounts, num_pages,
            page_table.stride(0), expected_page_ids.stride(0), expected_tags.stride(0),
            expected_owners.stride(0), BLOCK=block, num_warps=4,
        )
    return valid, cause
