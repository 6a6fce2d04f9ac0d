"""Fused MoE in Triton: one grouped matmul over every expert's rows, the rows sorted by expert
and padded to BLOCK_M (`moe_align_block_size` in `kernels/triton/launch_moe.py`).

vLLM's and SGLang's `fused_moe_kernel` shape: program (m block, n block) reads its block's
expert from `expert_ids`, gathers its rows through `sorted_ids` (padding ids are >= num_valid
and masked), and exits when its block lies past `num_post_pad[0]`, so the grid is a function
of the padded upper bound only. Two epilogues: SwiGLU (the gate rows [0, N) and the up rows
[N, 2N) of one w13 tile pair, silu(gate) * up written once) and the router weight (a row's
top-k weight, on the down projection). Weights: bf16/fp16/fp32, block-FP8 (e4m3 bytes, one
fp32 scale per (row, 128-column block)), or INT4 (two codes per byte along K, low nibble first,
one bf16 scale per (row, group), 4-bit zero points or symmetric offset 8). Block-FP8 weights
also run W8A8 (W_FORMAT 3, SGLang's prefill form): the activations are e4m3 bytes with one
fp32 scale per (activation row, 128 columns), each 128-wide block's fp8 dot times both scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.fp8_block import _fp8_dot
from kernels.triton.paged_attention import _dot


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, z_ptrs, offs_k, k0, k_ok, n_ok, stride_wk, stride_sk,
                 W_FORMAT: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 dtype: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile at K offset k0 in `dtype`. FP8 tiles are unscaled
    (the block scale multiplies the partial product; W8A8 tiles stay e4m3 bytes, `dtype` is
    then the activations' uint8); INT4 tiles are dequantized here."""
    mask = k_ok[:, None] & n_ok[None, :]
    k = k0 + offs_k
    if W_FORMAT == 2:  # int4: byte k // 2 holds codes k (low nibble when k is even) and k + 1
        b = tl.load(w_ptrs + (k // 2)[:, None] * stride_wk, mask=mask, other=0)
        code = ((b >> ((k % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
        g = (k // GROUP_K)[:, None] * stride_sk
        s = tl.load(s_ptrs + g, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptrs + g, mask=mask, other=0).to(tl.float32)
        else:
            z = 8.0
        return ((code - z) * s).to(dtype)
    b = tl.load(w_ptrs + k[:, None] * stride_wk, mask=mask, other=0)
    if W_FORMAT == 1:
        b = b.to(tl.float8e4nv, bitcast=True)
    return b.to(dtype)


@triton.jit
def fused_moe_kernel(
    out_ptr, a_ptr, as_ptr, w_ptr, ws_ptr, wz_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, K, num_valid, a_row_div, up_offset,
    stride_am, stride_asm, stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, W_FORMAT: tl.constexpr, GROUP_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, SWIGLU: tl.constexpr, MUL_ROUTED: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # grid: (m blocks upper bound * n blocks,), grouped-M order for weight-tile reuse in L2.
    # out[id, n] for each sorted row id = sum_k a[id // a_row_div, k] * w[expert, n, k] (x2
    # with SWIGLU, rows n and up_offset + n), times topk_w[id] with MUL_ROUTED.
    # W_FORMAT: 0 float weights, 1 block-FP8 bytes, 2 packed INT4, 3 block-FP8 bytes times
    # e4m3 activation bytes with scales as_ptr [rows, ceil(K / 128)] (W8A8).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = ids < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (ids // a_row_div)[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + (ids // a_row_div) * stride_asm
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_se
    rows = offs_n.to(tl.int64)
    up_rows = (up_offset + offs_n).to(tl.int64)  # NOTE: scalar args may arrive as constexprs
    z_base = wz_ptr + expert * stride_se
    w_ptrs, w_up_ptrs = w_base + rows[None, :] * stride_wn, w_base + up_rows[None, :] * stride_wn
    s_ptrs, s_up_ptrs = s_base + rows[None, :] * stride_sn, s_base + up_rows[None, :] * stride_sn
    z_ptrs, z_up_ptrs = z_base + rows[None, :] * stride_sn, z_base + up_rows[None, :] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = _weight_tile(w_ptrs, s_ptrs, z_ptrs, offs_k, k0, k_ok, n_ok, stride_wk, stride_sk,
                         W_FORMAT, GROUP_K, HAS_ZEROS, a.dtype)
        if W_FORMAT == 3:  # one activation scale per (row, 128 columns)
            a_s = tl.load(as_ptrs + k0 // 128, mask=row_ok, other=0.0)
            part = _fp8_dot(a, b, DOT_F32) * a_s[:, None]
        else:
            part = _dot(a, b, DOT_F32)
        if W_FORMAT == 1 or W_FORMAT == 3:  # one scale per (row, 128 columns): BLOCK_K | 128
            s = tl.load(s_base + rows * stride_sn + (k0 // 128) * stride_sk, mask=n_ok,
                        other=0.0)
            part = part * s[None, :]
        acc += part
        if SWIGLU:
            b = _weight_tile(w_up_ptrs, s_up_ptrs, z_up_ptrs, offs_k, k0, k_ok, n_ok,
                             stride_wk, stride_sk, W_FORMAT, GROUP_K, HAS_ZEROS, a.dtype)
            if W_FORMAT == 3:
                part = _fp8_dot(a, b, DOT_F32) * a_s[:, None]
            else:
                part = _dot(a, b, DOT_F32)
            if W_FORMAT == 1 or W_FORMAT == 3:
                s = tl.load(s_base + up_rows * stride_sn + (k0 // 128) * stride_sk,
                            mask=n_ok, other=0.0)
                part = part * s[None, :]
            acc_up += part
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED:
        acc = acc * tl.load(topk_w_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + ids[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
