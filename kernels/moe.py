"""Routed-expert compute for mixture-of-experts layers (SwiGLU experts), grouped by expert.

The (token, expert) pairs the router chose are sorted by expert (`moe_align`), so each expert's
rows are contiguous: one matmul per expert that received tokens (never a Python loop over
tokens), then the rows are scaled by their routing weights and scattered back onto their tokens
with one `index_add_`. This is vLLM's and SGLang's fused-MoE layout (sorted token ids plus
per-expert offsets), so a GPU kernel over the same sorted rows computes the same sums.

The `fused_moe` op takes experts as stored (float, block-FP8 or INT4, `dequantize_expert`); its
twin is the loop below, its CUDA kernel the Triton grouped matmul. On CPU the torch path is the
production path: `torch.nn.functional.grouped_mm` exists in
torch 2.13 but runs ~14x slower on CPU than one matmul per expert (measured 2026-11-30:
297 ms vs 22 ms for 8 experts, 128 rows, 576 x 512), and needs 16-byte-aligned strides.
Importing this module never needs a GPU or Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.fp8 import decode_e4m3_bits
from kernels.triton.gemm_ref import ref_dequant_fp8_blocks, ref_quant_fp8_groups


class ExpertRows(NamedTuple):
    """The router's (token, expert) pairs, sorted by expert."""

    order: torch.Tensor  # [T * top_k] long: position in topk_ids.flatten() of each sorted row
    tokens: torch.Tensor  # [T * top_k] long: the token each sorted row belongs to
    counts: list[int]  # [num_experts]: rows per expert, in sorted order


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> ExpertRows:
    """Sort the router's choices by expert. topk_ids: [T, top_k] integer expert ids in
    [0, num_experts). One host sync (the per-expert counts)."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"expert id out of range [0, {num_experts})")
    return ExpertRows(order, order // topk_ids.shape[1], counts.tolist())


def ref_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for SwiGLU experts.

    x: [T, hidden]; w13: [E, 2 * inter, hidden] (gate rows, then up rows, as HF's
    `gate_up_proj`); w2: [E, hidden, inter]; topk_weights: [T, top_k] (any float dtype);
    topk_ids: [T, top_k] integer. Returns [T, hidden] in x's dtype. Experts that received no
    row cost nothing.
    """
    num_experts, hidden = w13.shape[0], x.shape[1]
    assert w13.shape[2] == hidden and w2.shape[:2] == (num_experts, hidden), (w13.shape, w2.shape)
    return _grouped_moe(x, w13.__getitem__, w2.__getitem__, num_experts, topk_weights, topk_ids)


def fp8_activation_round(a: torch.Tensor) -> torch.Tensor:
    """a [rows, K] through e4m3 per (row, 128 columns) and back, float32: what W8A8's
    activation quantizer (`fp8_scale`'s rule, as `fp8_block_linear` quantizes x) keeps."""
    q, s = ref_quant_fp8_groups(a)
    return ref_dequant_fp8_blocks(q, s, 1)


def _grouped_moe(x: torch.Tensor, expert13: Callable[[int], torch.Tensor],
                 expert2: Callable[[int], torch.Tensor], num_experts: int,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 fp8_activations: bool = False) -> torch.Tensor:
    """The per-expert loop over experts given as functions of their index (dense [N, K], in
    the dtype the matmuls run in). `fp8_activations` (W8A8): each projection's input rounded
    through e4m3 per (row, 128 columns) (`fp8_activation_round`, the SwiGLU activation first
    stored in x's dtype), the matmuls in float32, each row times its routing weight stored in
    x's dtype and the top-k sum in float32: the grouped launches' roundings."""
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    rows = moe_align(topk_ids, num_experts)
    xs = x.index_select(0, rows.tokens)
    ys = torch.empty_like(xs)
    if fp8_activations:
        xs = fp8_activation_round(xs)
        ys = ys.float()
    start = 0
    for expert, n in enumerate(rows.counts):
        if n:
            gate, up = F.linear(xs[start : start + n], expert13(expert)).chunk(2, dim=-1)
            act = F.silu(gate) * up
            if fp8_activations:
                act = fp8_activation_round(act.to(x.dtype))
            ys[start : start + n] = F.linear(act, expert2(expert))
            start += n
    ys.mul_(topk_weights.reshape(-1).index_select(0, rows.order).to(ys.dtype).unsqueeze(1))
    if fp8_activations:
        ys = ys.to(x.dtype).float()
        return torch.zeros_like(ys[: x.shape[0]]).index_add_(0, rows.tokens, ys).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows.tokens, ys)


EXPERT_KINDS = ("float", "fp8-block", "int4")
FP8_EXPERT_BLOCK = 128  # block-FP8 experts: one scale per (row, 128 columns)


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor | None, zeros: torch.Tensor | None,
                      kind: str, group_size: int, expert: int) -> torch.Tensor:
    """One expert's projection [N, K] as float32 from the stacked stored form (`fused_moe`'s
    kinds): "float" as is; "fp8-block" e4m3 [E, N, K] times scale fp32 [E, N, ceil(K/128)];
    "int4" codes two a byte low nibble first [E, N, K/2], (q - zero) * scale per group of
    `group_size` (scale [E, N, K/g], zeros uint8 like it or None: zero 8). ValueError for
    another kind."""
    if kind == "float":
        return w[expert].float()
    if kind not in EXPERT_KINDS:
        raise ValueError(f"expert weight kind must be one of {EXPERT_KINDS}, got {kind!r}")
    assert scale is not None
    if kind == "fp8-block":
        k = w.shape[2]
        s = scale[expert].float().repeat_interleave(FP8_EXPERT_BLOCK, dim=1)[:, :k]
        return decode_e4m3_bits(w[expert]) * s
    packed = w[expert]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).float()
    s = scale[expert].float().repeat_interleave(group_size, dim=1)
    z = 8.0 if zeros is None else zeros[expert].float().repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def ref_fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                     w13_zeros: torch.Tensor | None, w2: torch.Tensor,
                     w2_scale: torch.Tensor | None, w2_zeros: torch.Tensor | None,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, kind: str = "float",
                     group_size: int = 0, fp8_activations: bool = False) -> torch.Tensor:
    """Twin of the `fused_moe` op: `ref_fused_moe` over experts stored as `kind`
    (`dequantize_expert`), each used expert dequantized in x's dtype, the others untouched.
    `fp8_activations` (block-FP8 experts only): W8A8, both projections' inputs rounded through
    e4m3 per (row, 128 columns) and the matmuls in float32 (`_grouped_moe`); ValueError for
    another kind."""
    if fp8_activations and kind != "fp8-block":
        raise ValueError(f"W8A8 (fp8_activations) takes fp8-block experts, not {kind!r}")
    if kind == "float":
        return ref_fused_moe(x, w13, w2, topk_weights, topk_ids)
    dtype = torch.float32 if fp8_activations else x.dtype

    def expert13(e: int) -> torch.Tensor:
        return dequantize_expert(w13, w13_scale, w13_zeros, kind, group_size, e).to(dtype)

    def expert2(e: int) -> torch.Tensor:
        return dequantize_expert(w2, w2_scale, w2_zeros, kind, group_size, e).to(dtype)
    return _grouped_moe(x, expert13, expert2, w13.shape[0], topk_weights, topk_ids,
                        fp8_activations)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None, w13_zeros: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None,
              kind: str = "float", group_size: int = 0,
              fp8_activations: bool = False) -> torch.Tensor:
    """The routed experts' output [T, hidden] through the `fused_moe` op (shapes:
    `ref_fused_moe`; stored kinds: `dequantize_expert`; `fp8_activations`: W8A8 over
    block-FP8 experts, `ref_fused_moe_op`). CPU runs the twin (one matmul per expert with
    rows); CUDA the Triton grouped kernel (`kernels/triton/launch_moe.py`)."""
    return torch.ops.tessera.fused_moe(x, w13, w13_scale, w13_zeros, w2, w2_scale, w2_zeros,
                                       topk_weights, topk_ids, kind, group_size, fp8_activations)
