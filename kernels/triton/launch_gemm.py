"""Launchers for the Triton matmuls: W4A16 INT4 (`w4a16.py`, weights as `Int4Tiles`) and
block-FP8 with its activation quantizer (`fp8_block.py`). Shape and dtype asserts, tile
configs chosen by M, split-K counts; no launcher reads a device value and every grid is a
function of shapes only (CUDA-graph safe per batch bucket). triton is imported on first launch.

Ops they implement (not registered here): `w4a16_linear` is the CUDA form of the INT4 linear
(`Int4Linear.forward`, and Q4_0 / Q4_1 blocks' `q4_linear`); `fp8_block_linear` of the
block-scaled `Fp8Linear.forward`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from kernels.triton.gemm_ref import FP8_GROUP
from kernels.triton.int4_layout import Int4Tiles

MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 2
K_STEP = 128  # weights per W4A16 K-loop step: 64 bytes a row per step whatever the group
_ACT = (torch.bfloat16, torch.float16)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
# codes as half floats by bit pattern (w4a16.py `_group_dot`)
_CODE_BIAS = {torch.bfloat16: dict(MAGIC=0x4300, UNBIAS=0.0, BIAS=128.0),
              torch.float16: dict(MAGIC=0x6400, UNBIAS=1024.0, BIAS=0.0)}


def _jit() -> Any:
    from kernels.triton import fp8_block, w4a16

    return w4a16, fp8_block


@functools.cache
def _interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernels widen dot operands to fp32 (see `_group_dot`). Read
    once: the mode is fixed when triton is imported (an environment read costs ~1 us a call)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H200's 132 elsewhere (the interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 132


def w4a16_config(m: int) -> dict[str, int]:
    """Tile config by rows: decode buckets (M <= 32) take one 16- or 32-row block over every row
    and rely on split-K for parallelism; past that a GEMM tiling with grouped-M order."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 32:
        return dict(BLOCK_M=32, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def w4a16_num_splits(m: int, n: int, k: int, sms: int) -> int:
    """Split-K count: a power of two <= 16 giving ~2 programs per SM when the (m, n) tiles
    alone would leave SMs idle, each split keeping >= 2 K steps (256 weights). Shapes only
    (graph safe); the split changes fp32 summation order only, and a shape always gets the
    same one."""
    cfg = w4a16_config(m)
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    steps = -(-k // K_STEP)
    splits = 1
    while (splits * 2 <= MAX_SPLITS and tiles * splits * 2 <= 2 * sms
           and steps // (splits * 2) >= MIN_STEPS_PER_SPLIT):
        splits *= 2
    return splits


class W4A16Plan(NamedTuple):
    """What a W4A16 launch of one shape needs besides its tensors (`w4a16_plan`)."""

    cfg: Mapping[str, int]  # `w4a16_config`, read-only (the plan is shared)
    step: int  # weights per K-loop step
    per_split: int  # K steps per split
    splits: int
    grid: tuple[int, int]


@functools.lru_cache(maxsize=4096)
def w4a16_plan(m: int, n: int, k: int, group_size: int, sms: int,
               split_k: int | None = None) -> W4A16Plan:
    """The tile config, split-K and grid of an [m, k] x [k, n] launch, computed once per
    shape: a decode step calls every linear's launcher at the same few shapes, and the
    host time of this arithmetic is paid by every eager launch (a replayed graph pays none)."""
    cfg = w4a16_config(m)
    step = max(K_STEP, group_size)
    steps = -(-k // step)
    splits = split_k or w4a16_num_splits(m, n, k, sms)
    per_split = -(-steps // splits)
    splits = -(-steps // per_split)
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]), splits)
    return W4A16Plan(MappingProxyType(cfg), step, per_split, splits, grid)


def _out_buffer(out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=device)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous(), \
        (out.shape, out.dtype, m, n, dtype)
    return out


def w4a16_linear(x: torch.Tensor, w: Int4Tiles, out_dtype: torch.dtype | None = None,
                 split_k: int | None = None, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T over INT4 tiles. x: [..., K] bf16/fp16 (last dim contiguous); returns
    [..., N] in out_dtype (default x's; float32 allowed), written into `out` ([rows, N],
    contiguous) when given. split_k: None picks `w4a16_num_splits`; at most one split per
    128-weight K step is used (fewer if they divide unevenly). More than one writes fp32
    partials into `workspace` ([>= split_k, rows, N] float32 contiguous, else allocated) and
    sums them in split order. AssertionError on shapes or dtypes."""
    w4a16 = _jit()[0]
    k, n = w.in_features, w.out_features
    assert x.shape[-1] == k and x.dtype in _ACT, (x.shape, x.dtype, k)
    out_dtype = out_dtype or x.dtype
    assert out_dtype in _OUT, out_dtype
    assert w.d.shape == (-(-k // w.group_size), n), (w.d.shape, k, w.group_size, n)
    assert w.offset is None or (w.offset.shape == w.d.shape and w.offset.stride() == w.d.stride())
    assert w.qt.dtype == torch.uint8 and w.qt.is_contiguous() and w.d.is_contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    assert x2.stride(-1) == 1
    m = x2.shape[0]
    y = _out_buffer(out, m, n, out_dtype, x.device)
    if m == 0:
        return y.view(*lead, n)
    cfg, step, per_split, splits, grid = w4a16_plan(m, n, k, w.group_size, num_sms(x.device),
                                                    split_k)
    target = y
    if splits > 1:
        if workspace is None:
            workspace = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        assert workspace.shape[0] >= splits and workspace.shape[1:] == (m, n), workspace.shape
        assert workspace.dtype == torch.float32 and workspace.is_contiguous()
        workspace = target = workspace[:splits]
    w4a16.w4a16_kernel[grid](
        target, x2, w.qt, w.d, w.offset if w.offset is not None else w.d,
        m, n, k, w.d.shape[0], per_split,
        x2.stride(0), w.qt.stride(0), w.d.stride(0), n, m * n if splits > 1 else 0,
        GROUP=w.group_size, STEP=step, OFFSET=w.offset_kind, **_CODE_BIAS[x.dtype],
        SPLIT=splits > 1,
        DOT_F32=_interpreted(), **cfg,
    )
    if splits > 1:
        block = 1024
        w4a16.reduce_splits_kernel[(-(-m * n // block),)](y, workspace, splits, m * n,
                                                          BLOCK=block, num_warps=4)
    return y.view(*lead, n)


def quant_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16/fp32 (last dim contiguous) -> (e4m3 bytes uint8 [M, K], fp32 scales
    [M, ceil(K / group)]), `ref_quant_fp8_groups` in one launch of (row, group) programs."""
    fp8 = _jit()[1]
    assert x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (*_ACT, torch.float32), \
        (x.shape, x.dtype)
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        fp8.quant_fp8_groups_kernel[(m, groups)](q, s, x, k, x.stride(0), q.stride(0),
                                                 s.stride(0), GROUP=group,
                                                 SOFT_FP8=_interpreted(), num_warps=1)
    return q, s


def fp8_config(m: int) -> dict[str, int]:
    """SGLang's default block-FP8 tile (BM 64, BN 128, BK 128, grouped M, 4 warps, 3 stages)
    with BM narrowed for few rows and widened for prefill-sized M."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 32:
        return dict(BLOCK_M=32, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype in (torch.uint8, torch.float8_e4m3fn), t.dtype
    return t.view(torch.uint8)


def fp8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = dequant(a) @ dequant(w)^T, fp32-accumulated per 128-wide K block.
    a: e4m3 (uint8 bytes or float8_e4m3fn) [M, K], a_scale fp32 [M, ceil(K/128)]; w: e4m3
    [N, K], w_scale fp32 [ceil(N/128), ceil(K/128)] (DeepSeek-V3's weight_scale_inv) or
    [N, ceil(K/128)] (one per row, `expand_block_rows`). AssertionError on shapes or dtypes."""
    fp8 = _jit()[1]
    a, w = _bytes(a), _bytes(w)
    m, k = a.shape
    n = w.shape[0]
    kb = -(-k // FP8_GROUP)
    assert w.shape == (n, k) and a.stride(-1) == 1 and w.stride(-1) == 1, (a.shape, w.shape)
    assert a_scale.shape == (m, kb) and a_scale.dtype == torch.float32, a_scale.shape
    assert w_scale.dtype == torch.float32 and w_scale.shape[1] == kb, w_scale.shape
    scale_rows = FP8_GROUP if w_scale.shape[0] == -(-n // FP8_GROUP) else 1
    assert w_scale.shape[0] == -(-n // scale_rows), (w_scale.shape, n)
    assert out_dtype in _OUT, out_dtype
    y = _out_buffer(out, m, n, out_dtype, a.device)
    if m == 0:
        return y
    cfg = fp8_config(m)
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]),)
    fp8.fp8_block_matmul_kernel[grid](
        y, a, a_scale, w, w_scale, m, n, k,
        a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0), w_scale.stride(1), n,
        SCALE_ROWS=scale_rows, BLOCK_K=FP8_GROUP, DOT_F32=_interpreted(), **cfg,
    )
    return y


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N]: `quant_fp8_groups` then `fp8_block_matmul` (the
    block-scaled Fp8Linear forward without bias)."""
    lead = x.shape[:-1]
    q, s = quant_fp8_groups(x.reshape(-1, x.shape[-1]))
    y = fp8_block_matmul(q, s, w, w_scale, out_dtype or x.dtype)
    return y.view(*lead, w.shape[0])
