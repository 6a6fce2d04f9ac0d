"""Attention over paged KV: decode (one query token per sequence) and a prefill chunk.

The reference twins gather a sequence's pages into contiguous per-head context and run
batched matmuls; query heads are grouped under their KV head (GQA) so nothing is repeated.
Pages may be fp32/bf16/fp16, or a 1-byte format (fp8 e4m3 bytes as uint8, or symmetric int8:
`kernels/int8.py`) with one scale per (token, head): decode folds those scales into scores and
probabilities, prefill dequantizes the context.
On CPU, decode runs the C++ op (`kernels/cpu/paged_decode.cpp`), which reads pages in their
storage format row by row instead of gathering a float copy; the torch twin is its oracle.
With `hadamard` (fp8 / int8 pages written by `store_kv(..., hadamard=True)`), K and V are stored
rotated: q is rotated the same way (q.k unchanged) and the output rotated back, per head
(`kernels/hadamard.py`, QuaRot's online Hadamard). With `q_scale` / `out_scale` ([kv_heads,
dim] float32, smoothed quantized pages: `runtime/kv/smoothing.py`), each query is multiplied
by its KV head's q_scale before that rotation and each output by out_scale after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu_ops import native, native_ops
from kernels.hadamard import fwht
from kernels.int8 import is_quantized_kv
from kernels.kv_fp8 import gather_e4m3_rows, ref_gather_e4m3_rows

RowGather = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _page_rows(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Row indices into cache.view(heads * pages, page_size * dim) for every head's pages."""
    heads, pages = cache.shape[0], cache.shape[1]
    head_base = torch.arange(heads, device=page_ids.device).mul_(pages).view(heads, 1)
    return (head_base + page_ids.reshape(1, -1)).reshape(-1)


def _gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, rows: torch.Tensor,
                  dtype: torch.dtype, gather: RowGather) -> torch.Tensor:
    # cache: [kv_heads, pages, page_size, dim]; page_ids: [..., max_pages]
    # -> [kv_heads, ..., max_pages * page_size, dim] in `dtype` (1-byte codes decoded,
    # unscaled: int8 by a plain convert)
    # NOTE: one dim-0 index_select over whole (head, page) rows: each copy is a contiguous
    # page, ~2.5x faster on CPU than index_select along the page dimension.
    heads, pages, page_size, dim = cache.shape
    flat = cache.view(heads * pages, page_size * dim)
    if cache.dtype == torch.uint8:
        out = gather(flat, rows).to(dtype)
    else:
        out = flat.index_select(0, rows).to(dtype)
    return out.view(heads, *page_ids.shape[:-1], page_ids.shape[-1] * page_size, dim)


def _gather_scales(scale: torch.Tensor, page_ids: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    # scale: [kv_heads, pages, page_size] -> [kv_heads, ..., max_pages * page_size] float32
    heads, pages, page_size = scale.shape
    flat = scale.view(heads * pages, page_size).index_select(0, rows).float()
    return flat.view(heads, *page_ids.shape[:-1], page_ids.shape[-1] * page_size)


def _per_kv_head(x: torch.Tensor, factor: torch.Tensor | None, kv_heads: int) -> torch.Tensor:
    """x: [tokens, heads, dim] times factor [kv_heads, dim] along each head's KV head."""
    if factor is None:
        return x
    tokens, heads, dim = x.shape
    return (x.view(tokens, kv_heads, heads // kv_heads, dim) * factor[:, None]).view(x.shape)


def ref_paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None,
                               hadamard: bool = False, q_scale: torch.Tensor | None = None,
                               out_scale: torch.Tensor | None = None, *,
                               gather: RowGather = ref_gather_e4m3_rows) -> torch.Tensor:
    # q: [batch, heads, dim]; page_table: [batch, max_pages]; context_lens: [batch] long
    # gather: how fp8 pages' rows are decoded (the pure torch twin, or the op)
    batch, num_heads, dim = q.shape
    rotated = hadamard and is_quantized_kv(k_cache.dtype)
    kv_heads, _, page_size, _ = k_cache.shape
    q = _per_kv_head(q.contiguous(), q_scale, kv_heads)
    if rotated:
        q = fwht(q).to(q.dtype)
    group = num_heads // kv_heads
    positions = torch.arange(page_table.shape[1] * page_size, device=q.device)
    mask = positions.unsqueeze(0) < context_lens.unsqueeze(1)
    rows = _page_rows(k_cache, page_table)
    k = _gather_pages(k_cache, page_table, rows, q.dtype, gather)  # [kv_heads, batch, L, dim]
    v = _gather_pages(v_cache, page_table, rows, q.dtype, gather)
    qg = q.view(batch, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, batch, group, dim]
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [kv_heads, batch, group, L]
    if k_scale is not None:
        scores.mul_(_gather_scales(k_scale, page_table, rows).mul_(scale).unsqueeze(2))
    else:
        scores.mul_(scale)
    scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if v_scale is not None:
        probs.mul_(_gather_scales(v_scale, page_table, rows).unsqueeze(2))
    out = torch.matmul(probs.to(v.dtype), v)  # [kv_heads, batch, group, dim]
    if rotated:
        out = fwht(out).to(q.dtype)
    out = _per_kv_head(out.transpose(0, 1).reshape(batch, num_heads, dim), out_scale, kv_heads)
    return out.reshape(batch, num_heads * dim)


def ref_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_ids: torch.Tensor, context_len: int,
                                mask: torch.Tensor | None, scale: float,
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None,
                                hadamard: bool = False, q_scale: torch.Tensor | None = None,
                                out_scale: torch.Tensor | None = None, *,
                                gather: RowGather = ref_gather_e4m3_rows) -> torch.Tensor:
    # q: [chunk, heads, dim] for one sequence; keys are its first context_len cached tokens.
    # mask: [chunk, context_len] bool (True = attend) or None for plain causal from position 0.
    chunk, num_heads, dim = q.shape
    rotated = hadamard and is_quantized_kv(k_cache.dtype)
    kv_heads = k_cache.shape[0]
    q = _per_kv_head(q.contiguous(), q_scale, kv_heads)
    if rotated:
        q = fwht(q).to(q.dtype)
    rows = _page_rows(k_cache, page_ids)
    # [kv_heads, L, dim]
    k = _gather_pages(k_cache, page_ids, rows, q.dtype, gather)[:, :context_len]
    v = _gather_pages(v_cache, page_ids, rows, q.dtype, gather)[:, :context_len]
    if k_scale is not None and v_scale is not None:
        k = k * _gather_scales(k_scale, page_ids, rows)[:, :context_len, None].to(q.dtype)
        v = v * _gather_scales(v_scale, page_ids, rows)[:, :context_len, None].to(q.dtype)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None, scale=scale, enable_gqa=kv_heads != num_heads,
    )[0]  # [heads, chunk, dim]
    if rotated:
        out = fwht(out).to(q.dtype)
    out = _per_kv_head(out.transpose(0, 1).contiguous(), out_scale, kv_heads)
    return out.reshape(chunk, num_heads * dim)


def decode_pads_to_longest(device: torch.device) -> bool:
    """True when decode attention costs every sequence its batch's longest context (the torch
    twin pads to it); the C++ op reads each sequence's own pages only."""
    return not (device.type == "cpu" and native() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           hadamard: bool = False, q_scale: torch.Tensor | None = None,
                           out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """As `ref_paged_decode_attention`, through the `paged_decode_attention` op (float32 q:
    the CPU kernel's input; other dtypes run the twin)."""
    if q.dtype != torch.float32:
        return ref_paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale,
                                          k_scale, v_scale, hadamard, q_scale, out_scale,
                                          gather=gather_e4m3_rows)
    return native_ops().paged_decode_attention(q, k_cache, v_cache, page_table, context_lens,
                                               scale, k_scale, v_scale, hadamard, q_scale,
                                               out_scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_ids: torch.Tensor, context_len: int, mask: torch.Tensor | None,
                            scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            hadamard: bool = False, q_scale: torch.Tensor | None = None,
                            out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """As `ref_paged_prefill_attention`, through the `paged_prefill_attention` op."""
    return native_ops().paged_prefill_attention(q, k_cache, v_cache, page_ids, context_len, mask,
                                                scale, k_scale, v_scale, hadamard, q_scale,
                                                out_scale)


def cpu_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_ids: torch.Tensor, context_len: int,
                                mask: torch.Tensor | None, scale: float,
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None, hadamard: bool = False,
                                q_scale: torch.Tensor | None = None,
                                out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel of `paged_prefill_attention` (registered where the C++ build loads).

    A causal chunk (mask None from position 0, or the mask offset by the tokens already cached,
    as `runtime.attention.backend` builds it) with float32 q runs the C++ decode kernel with one
    query token per row, each over its own context: one serial reduction per (token, KV head),
    the very operations a decode step runs for that position, so a token's output never
    depends on how the prompt was cut into chunks or what was cached before it (batch
    invariance, docs/DESIGN.md). Any other mask or dtype: the twin, with fp8 rows decoded by
    the C++ `gather_e4m3_rows` (bit-exact, faster)."""
    chunk, start = q.shape[0], context_len - q.shape[0]
    if q.dtype == torch.float32 and _causal_from(mask, start, context_len):
        lens = torch.arange(start + 1, context_len + 1, device=q.device)
        table = page_ids.reshape(1, -1).expand(chunk, -1).contiguous()
        return native_ops().paged_decode_attention(q, k_cache, v_cache, table, lens, scale,
                                                   k_scale, v_scale, hadamard, q_scale,
                                                   out_scale)
    return ref_paged_prefill_attention(q, k_cache, v_cache, page_ids, context_len, mask, scale,
                                       k_scale, v_scale, hadamard, q_scale, out_scale,
                                       gather=gather_e4m3_rows)


def _causal_from(mask: torch.Tensor | None, start: int, context_len: int) -> bool:
    """Whether `mask` lets row i of a chunk at positions start.. see exactly keys 0..start+i."""
    if start < 0:
        return False
    if mask is None:
        return start == 0
    rows = torch.arange(start, context_len, device=mask.device).unsqueeze(1)
    want = torch.arange(context_len, device=mask.device).unsqueeze(0) <= rows
    return mask.dtype == torch.bool and mask.shape == want.shape and bool(torch.equal(mask, want))
