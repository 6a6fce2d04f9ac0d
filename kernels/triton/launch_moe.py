"""Launchers for the fused-MoE Triton kernel: the sort-and-pad of the router's choices on the
device, the expert-weight layouts the kernel reads, and the two grouped launches of a SwiGLU
expert layer (`kernels/moe.py`'s `ref_fused_moe` is the twin, the per-expert loop).

Nothing here reads a device value: `moe_align_block_size` is torch ops on the device (no
`bincount`, whose CUDA kernel syncs to size its output), and every grid is a function of
(tokens, top_k, experts, block size) only, so a decode step can be captured in a CUDA graph
per batch bucket. triton is imported on first launch, never at import time.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

WEIGHT_KINDS = {"float": 0, "fp8-block": 1, "int4": 2}  # -> the kernel's W_FORMAT
FP8_BLOCK_K = 128  # DeepSeek-V3's weight_block_size along the input dimension
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _jit() -> Any:
    from kernels.triton import fused_moe

    return fused_moe


def _quantizer() -> Any:
    from kernels.triton.launch_gemm import quant_fp8_groups

    return quant_fp8_groups


@functools.cache
def _interpreted() -> bool:
    """Read once: the interpreter mode is fixed when triton is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class MoeAlignment(NamedTuple):
    """The router's (token, k) rows grouped by expert, each expert's run padded to block_m."""

    sorted_ids: torch.Tensor  # [max_rows] int32: flat ids t * top_k + k; padding = num_valid
    expert_ids: torch.Tensor  # [max_blocks] int32: each block's expert (-1 past the end)
    num_post_pad: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    num_valid: int  # tokens * top_k
    block_m: int


def max_padded_rows(num_valid: int, num_experts: int, block_m: int) -> int:
    """The most rows the padded sort can use: at most min(E, rows) experts receive a row, each
    padded by < block_m (vLLM sizes by E alone, which at decode launches mostly idle blocks)."""
    bound = num_valid + min(num_experts, num_valid) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> MoeAlignment:
    """Sort the router's choices topk_ids [T, top_k] (ids in [0, num_experts)) by expert on
    the device, stable (an expert's rows keep token order), each expert's run padded to a
    multiple of block_m. Experts that received no row get no block. Ids out of range fail in
    torch's scatter (an IndexError on CPU, a device-side assert on CUDA)."""
    assert topk_ids.dim() == 2 and not topk_ids.is_floating_point(), (topk_ids.shape,
                                                                       topk_ids.dtype)
    assert block_m > 0 and num_experts > 0
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    rows = flat.numel()
    max_rows = max_padded_rows(rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    by_expert, order = torch.sort(flat, stable=True)
    rank = torch.arange(rows, device=dev) - start[by_expert]
    sorted_ids = torch.full((max_rows,), rows, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pad_start[by_expert] + rank, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, expert_ids, pad_end[-1:].to(torch.int32), rows, block_m)


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert, stacked, as the kernel reads it.

    kind "float": weight [E, N, K] bf16/fp16/fp32.
    kind "fp8-block": weight [E, N, K] e4m3 (float8_e4m3fn or its bytes as uint8), scale
      float32 [E, N, ceil(K / 128)]: one per (row, 128-column block), tessera's in-memory form
      of DeepSeek-V3's 128x128 `weight_scale_inv` (`runtime/quant/fp8.py`, `expand_block_rows`).
    kind "int4": weight uint8 [E, N, K / 2], codes 0..15 two per byte low nibble first
      (`runtime/quant/int4.py`'s `pack_int4(..., torch.uint8)`), scale [E, N, K / group_size]
      bf16/fp32, zeros uint8 [E, N, K / group_size] (asymmetric) or None (symmetric, offset 8).
    ValueError on shapes or dtypes that do not fit the kind.
    """

    weight: torch.Tensor
    kind: str = "float"
    scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group_size: int = 0

    def __post_init__(self) -> None:
        w, s = self.weight, self.scale
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"expert weight kind must be one of {sorted(WEIGHT_KINDS)}, "
                             f"got {self.kind!r}")
        if w.dim() != 3 or w.stride(-1) != 1:
            raise ValueError(f"expert weights are [E, N, K] with contiguous rows, got "
                             f"{tuple(w.shape)} strides {w.stride()}")
        if self.kind == "float":
            if w.dtype not in _FLOATS or s is not None or self.zeros is not None:
                raise ValueError(f"float expert weights are bf16/fp16/fp32 without scales, "
                                 f"got {w.dtype}")
            return
        if s is None or s.dim() != 3 or s.shape[:2] != w.shape[:2]:
            raise ValueError(f"{self.kind} expert weights need scales [E, N, blocks], got "
                             f"{None if s is None else tuple(s.shape)} for {tuple(w.shape)}")
        if self.kind == "fp8-block":
            if w.dtype not in (torch.uint8, torch.float8_e4m3fn) or s.dtype != torch.float32:
                raise ValueError(f"fp8-block experts: e4m3 weights and float32 scales, got "
                                 f"{w.dtype} / {s.dtype}")
            if s.shape[2] != -(-w.shape[2] // FP8_BLOCK_K) or self.zeros is not None:
                raise ValueError(f"fp8-block scales [E, N, ceil(K/128)], got {tuple(s.shape)}")
            return
        g = self.group_size
        if w.dtype != torch.uint8 or g <= 0 or (2 * w.shape[2]) % g or s.shape[2] != \
                2 * w.shape[2] // g:
            raise ValueError(f"int4 experts: packed uint8 [E, N, K/2] and scales "
                             f"[E, N, K/group_size], got {w.dtype} {tuple(w.shape)}, scales "
                             f"{tuple(s.shape)}, group_size {g}")
        z = self.zeros
        if z is not None and (z.shape != s.shape or z.dtype != torch.uint8):
            raise ValueError(f"int4 zero points: uint8 like the scales {tuple(s.shape)}, got "
                             f"{z.dtype} {tuple(z.shape)}")
        if s.stride() != (z if z is not None else s).stride():
            raise ValueError("int4 scales and zero points must share one layout")

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2] * (2 if self.kind == "int4" else 1)


class MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int


def moe_config(num_rows: int, num_experts: int, kind: str = "float") -> MoeConfig:
    """Tiles by the number of routed rows: decode-sized batches (rows <= experts: about one
    row per expert) take 16-row blocks, as vLLM's default config; block-FP8 steps K by its
    128-column scale block. A function of shapes only (no recompiles within a bucket)."""
    block_k = FP8_BLOCK_K if kind == "fp8-block" else 64
    if num_rows <= num_experts:
        return MoeConfig(16, 64, block_k, 1)
    return MoeConfig(64, 64, block_k, 8)


def grouped_matmul(out: torch.Tensor, a: torch.Tensor, w: ExpertWeights, align: MoeAlignment,
                   config: MoeConfig, a_row_div: int, swiglu: bool = False,
                   topk_weights: torch.Tensor | None = None,
                   a_scale: torch.Tensor | None = None) -> None:
    """One launch over every expert: out[id] = a[id // a_row_div] @ w[expert(id)].T for each
    sorted row id (with swiglu: silu(gate) * up, gate rows [0, N/2) and up rows [N/2, N) of
    w; with topk_weights [T, top_k]: times the row's router weight). out: [num_valid, N or
    N/2] with contiguous rows; rows of other ids are not written. With `a_scale` (fp32
    [rows of a, ceil(K / 128)]), a is e4m3 bytes (uint8, `launch_gemm.quant_fp8_groups`) and
    w block-FP8: W8A8. AssertionError on shapes."""
    jit = _jit()
    w8a8 = a_scale is not None
    assert a.dim() == 2 and a.stride(-1) == 1, (a.shape, a.stride())
    assert a.dtype == torch.uint8 if w8a8 else a.dtype in _FLOATS, (a.dtype, w8a8)
    assert a.shape[1] == w.in_features, (a.shape, w.weight.shape, w.kind)
    n = w.out_features // 2 if swiglu else w.out_features
    assert not swiglu or w.out_features % 2 == 0
    assert out.shape == (align.num_valid, n) and out.stride(-1) == 1, (out.shape, n)
    fmt = WEIGHT_KINDS[w.kind]
    if w8a8:
        assert fmt == 1, "W8A8 takes block-FP8 experts"
        assert a_scale.dtype == torch.float32 and a_scale.shape == (
            a.shape[0], -(-a.shape[1] // FP8_BLOCK_K)), a_scale.shape
        fmt = 3
    assert fmt not in (1, 3) or FP8_BLOCK_K % config.block_k == 0, "fp8 K steps must divide 128"
    assert config.block_m == align.block_m, (config, align.block_m)
    weight = w.weight.view(torch.uint8) if w.weight.dtype == torch.float8_e4m3fn else w.weight
    scale = w.scale if w.scale is not None else weight
    zeros = w.zeros if w.zeros is not None else scale
    routed = topk_weights.reshape(-1) if topk_weights is not None else out
    if topk_weights is not None:
        assert routed.numel() == align.num_valid and routed.stride(0) == 1
    sorted_ids, expert_ids, num_post_pad = align.sorted_ids, align.expert_ids, align.num_post_pad
    grid = (expert_ids.numel() * -(-n // config.block_n),)
    quant = fmt != 0
    jit.fused_moe_kernel[grid](
        out, a, a_scale if w8a8 else a, weight, scale, zeros, routed, sorted_ids, expert_ids,
        num_post_pad, n, w.in_features, align.num_valid, a_row_div, n,
        a.stride(0), a_scale.stride(0) if w8a8 else 0,
        weight.stride(0), weight.stride(1), weight.stride(2),
        scale.stride(0) if quant else 0, scale.stride(1) if quant else 0,
        scale.stride(2) if quant else 0, out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, W_FORMAT=fmt, GROUP_K=max(w.group_size, 1),
        HAS_ZEROS=w.zeros is not None, SWIGLU=swiglu, MUL_ROUTED=topk_weights is not None,
        DOT_F32=_interpreted() or a.dtype == torch.float32, num_warps=4, num_stages=2,
    )


def fused_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: MoeConfig | None = None, out: torch.Tensor | None = None,
              fp8_activations: bool = False) -> torch.Tensor:
    """`ref_fused_moe` in two grouped launches: x [T, hidden] bf16/fp16/fp32; w13 [E,
    2 * inter, hidden] (gate rows, then up rows), w2 [E, hidden, inter], each any
    `ExpertWeights` kind; topk_weights, topk_ids [T, top_k]. Returns [T, hidden] in x's
    dtype (into `out` when given): sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]),
    the SwiGLU activation and each row's down projection stored in x's dtype between the
    launches (vLLM's and SGLang's rounding) and the top-k sum in fp32. `fp8_activations`
    (block-FP8 experts only): W8A8, x and the SwiGLU activation each quantized to e4m3 per
    (row, 128 columns) by `launch_gemm.quant_fp8_groups` before their launch (SGLang's
    prefill path)."""
    tokens, hidden = x.shape
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == tokens
    assert w13.num_experts == w2.num_experts and w13.in_features == hidden
    inter = w13.out_features // 2
    assert w2.in_features == inter and w2.out_features == hidden, (w13.weight.shape,
                                                                  w2.weight.shape)
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    assert out.shape == (tokens, hidden) and out.dtype == x.dtype
    if tokens == 0:
        return out
    rows = tokens * top_k
    config = config or moe_config(rows, w13.num_experts, w13.kind)
    align = moe_align_block_size(topk_ids, w13.num_experts, config.block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert not fp8_activations or w13.kind == w2.kind == "fp8-block", (w13.kind, w2.kind)
    quant = _quantizer() if fp8_activations else None
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    a, a_scale = quant(x) if quant else (x, None)
    grouped_matmul(act, a, w13, align, config, top_k, swiglu=True, a_scale=a_scale)
    down = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    down_config = config if w2.kind == w13.kind else config._replace(
        block_k=moe_config(rows, w2.num_experts, w2.kind).block_k)
    a, a_scale = quant(act) if quant else (act, None)
    grouped_matmul(down, a, w2, align, down_config, 1,
                   topk_weights=topk_weights.contiguous(), a_scale=a_scale)
    return out.copy_(down.view(tokens, top_k, hidden).sum(1, dtype=torch.float32))
