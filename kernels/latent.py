"""MLA latent page rows: how a token's latent (kv_lora_rank c_kv values, then rope k_pe values)
is written into, and read back from, one row of its latent page.

Float pages (fp32 / bf16 / fp16) hold the latent as it is, latent_dim elements. The 1-byte
formats hold FlashMLA's row: the c_kv part as fp8 e4m3 bytes (uint8) or symmetric int8 codes
with one bf16 scale per token in the page's scale tensor [1, pages, page_size], then the k_pe
part unquantized, as the bytes of its bf16 values, so a row is kv_lora_rank + 2 * rope elements
of the page dtype (DeepSeek-V3: 512 + 128 bytes, 642 with the scale). One scale over all 576
values lost the RoPE scores, whose range differs from the latent's (docs/DESIGN.md, "MLA
decode"). The split is read from the shapes alone: a row of width W holding a latent of D
values has rope = W - D (1-byte rows) and kv_lora_rank = D - rope, so no caller passes it.

The GPU kernels read this row in place (`kernels/triton/launch_mla.py`: the RoPE part through
`rope_view`); the CPU path dequantizes the pages a step touches (`dequantize_latent_pages`)
and runs the float paged-attention op over them.
"""

from __future__ import annotations

import torch

from kernels.int8 import dequantize_kv, is_quantized_kv, quantize_kv


def latent_split(row_width: int, latent_dim: int, page_dtype: torch.dtype) -> tuple[int, int]:
    """(kv_lora_rank, rope) of a latent of `latent_dim` values in rows of `row_width` elements
    of `page_dtype`; (latent_dim, 0) for float pages, where the row is the latent as it is.
    ValueError when the widths do not describe such a row."""
    if not is_quantized_kv(page_dtype):
        if row_width != latent_dim:
            raise ValueError(f"{page_dtype} latent rows hold {latent_dim} values, not {row_width}")
        return latent_dim, 0
    rope = row_width - latent_dim
    if not 0 < rope < latent_dim - rope:
        raise ValueError(f"a 1-byte latent row of {row_width} bytes cannot hold {latent_dim} "
                         f"values as codes plus a bf16 RoPE part")
    return latent_dim - rope, rope


def rope_view(cache: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The bf16 RoPE part of 1-byte latent pages [1, pages, page_size, kv_lora_rank + 2 * rope]
    as a view [1, pages, page_size, rope] (no copy; its slot stride is the row's, in bf16)."""
    return cache[..., kv_lora_rank:].view(torch.bfloat16)


def ref_store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     scale: torch.Tensor | None) -> None:
    """Write latents [tokens, 1, latent_dim] into rows of latent pages [1, pages, page_size, W]
    at flat slots [tokens] (-1: nothing written). 1-byte pages: the c_kv part's codes and bf16
    scale (kernels/int8.py's amax rule, one scale per token) and the RoPE part as bf16."""
    dim = latent.shape[-1]
    _, pages, page_size, width = cache.shape
    lora, rope = latent_split(width, dim, cache.dtype)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    rows = cache.view(pages * page_size, width)
    if rope == 0:
        assert scale is None, "scales are for 1-byte pages"
        rows.index_copy_(0, slot_mapping, latent[:, 0].to(cache.dtype))
        return
    assert scale is not None and scale.shape == cache.shape[:3], "1-byte pages need scales"
    codes, s = quantize_kv(latent[..., :lora], cache.dtype)  # [tokens, 1, lora], [tokens, 1]
    pe = latent[:, 0, lora:].to(torch.bfloat16).view(cache.dtype)  # [tokens, 2 * rope]
    rows.index_copy_(0, slot_mapping, torch.cat((codes[:, 0], pe), dim=-1))
    scale.view(pages * page_size).index_copy_(0, slot_mapping, s[:, 0].to(scale.dtype))


def dequantize_latent_rows(rows: torch.Tensor, scale: torch.Tensor, latent_dim: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """1-byte latent rows [..., kv_lora_rank + 2 * rope] and their scales [...] -> the latents
    [..., latent_dim] in `dtype` (c_kv times its scale, the RoPE part exactly its bf16)."""
    lora, _ = latent_split(rows.shape[-1], latent_dim, rows.dtype)
    c_kv = dequantize_kv(rows[..., :lora], scale, dtype)
    pe = rows[..., lora:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat((c_kv, pe), dim=-1)


def dequantize_latent_pages(cache: torch.Tensor, scale: torch.Tensor, latent_dim: int,
                            page_ids: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pages `page_ids` [n] of 1-byte latent pages [1, pages, page_size, W] (scales
    [1, pages, page_size]) as float pages [1, n, page_size, latent_dim] in `dtype`."""
    rows = cache[0].index_select(0, page_ids)
    return dequantize_latent_rows(rows, scale[0].index_select(0, page_ids), latent_dim,
                                  dtype).unsqueeze(0)
