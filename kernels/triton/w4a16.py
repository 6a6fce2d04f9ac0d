"""W4A16 group-wise INT4 matmul in Triton: y = x @ W^T, W [N, K] stored as 4-bit codes with a
scale per group of GROUP weights along K and an offset (symmetric, 4-bit zero points or a
GGUF Q4_1 `m` plane), bf16/fp16 activations, fp32 accumulation, optional split-K.

Weight layout (`kernels/triton/int4_layout.py` repacks tessera's and GGUF's forms into it once
at load): codes `qt` uint8 [K/2, N], K-major: byte row 16b + j holds, for every output n, the
code of weight 32b + j in its low nibble and of 32b + j + 16 in its high nibble (the q4 block
order of `kernels/qgemv.py`, transposed); `d` [ceil(K/GROUP), N] scales, `z` uint8 zero points
or `m` offsets of the same shape. A group's codes are GROUP/2 rows of N contiguous bytes, so
a tile of any width loads in whole 32-byte sectors.

Exactness: codes (biased, see `_group_dot`) are exact in bf16 / fp16 and their products with
the activations exact in fp32, so each group's dot is exact up to fp32 summation; the scale
and offset are applied to the group's fp32 partial sums (w = d * (q - z): y += d * (sum a*q -
z * sum a)), never rounded into a bf16 weight. Launchers: `kernels/triton/launch_gemm.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m block, n block) of program `pid` in the grouped-M order (L2 reuse of weight tiles)."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@triton.jit
def _group_dot(a, nibbles, MAGIC: tl.constexpr, UNBIAS: tl.constexpr, DOT_F32: tl.constexpr):
    """a [BM, k] activations @ (codes + bias) [k, BN] -> fp32, exact products. The codes become
    half floats by bit pattern, not conversion (as Marlin's dequant does, no cvt instructions):
    MAGIC | q reads as 128 + q in bf16 (0x4300) or 1024 + q in fp16 (0x6400). fp16 subtracts
    UNBIAS = 1024 here (exact); bf16 keeps the 128 (UNBIAS 0) and the caller subtracts
    128 * sum(a) from the fp32 result, which loses ~4 of fp32's 24 bits. DOT_F32 (the
    interpreter only): operands widened to fp32, because triton's interpreter multiplies bf16
    operands' raw bits (see `_dot` in paged_attention.py); the products are the same."""
    w = (nibbles.to(tl.uint16) | MAGIC).to(a.dtype, bitcast=True)
    if UNBIAS != 0:
        w = w - UNBIAS
    if DOT_F32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w)


@triton.jit
def w4a16_kernel(
    out_ptr, x_ptr, qt_ptr, d_ptr, off_ptr,
    M, N, K, num_groups, steps_per_split,
    stride_xm, stride_qk, stride_dg, stride_om, stride_os,
    GROUP: tl.constexpr, STEP: tl.constexpr, OFFSET: tl.constexpr, MAGIC: tl.constexpr,
    UNBIAS: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    # grid: (m blocks x n blocks, splits). The K loop steps STEP weights (STEP // GROUP whole
    # groups, unrolled, so a g32 step still loads 64 bytes a row); split s covers steps
    # [s * steps_per_split, ...) and, with SPLIT, writes fp32 partials out[s]
    # (`reduce_splits_kernel` sums them). OFFSET: 0 symmetric (z = 8), 1 uint8 zero points z,
    # 2 an offset plane m (w = d * q + m). MAGIC, UNBIAS: see `_group_dot`;
    # BIAS: what the dot's codes still carry (128 for bf16, 0 for fp16).
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = tl.arange(0, GROUP // 2)  # byte rows of one group
    k_lo = (rows // 16) * 32 + rows % 16  # the weight each row's low nibble holds
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    qt_cols = qt_ptr + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_start = split * steps_per_split
    s_end = tl.minimum(s_start + steps_per_split, tl.cdiv(K, STEP))
    for step in range(s_start, s_end):
        for i in tl.static_range(STEP // GROUP):
            g = step * (STEP // GROUP) + i
            k = g * GROUP + k_lo
            in_k = k < K  # the K tail, and a short last group (K % GROUP != 0, K % 32 == 0)
            a_mask = mask_m[:, None] & in_k[None, :]
            a_lo = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0)
            a_hi = tl.load(x_rows + k[None, :] + 16, mask=a_mask, other=0.0)
            byte_rows = (g * (GROUP // 2) + rows).to(tl.int64)
            w = tl.load(qt_cols + byte_rows[:, None] * stride_qk,
                        mask=in_k[:, None] & mask_n[None, :], other=0)
            part = _group_dot(a_lo, w & 0xF, MAGIC, UNBIAS, DOT_F32)
            part += _group_dot(a_hi, w >> 4, MAGIC, UNBIAS, DOT_F32)
            a_sum = tl.sum(a_lo.to(tl.float32), axis=1) + tl.sum(a_hi.to(tl.float32), axis=1)
            # NOTE: a vector compare: `mask_n & (g < num_groups)` fails in the interpreter
            g_mask = mask_n & (offs_n * 0 + g < num_groups)
            d = tl.load(d_ptr + g * stride_dg + offs_n, mask=g_mask, other=0.0).to(tl.float32)
            # BIAS folded into the per-column offset: one [BM, BN] multiply-add per group
            if OFFSET == 2:
                m = tl.load(off_ptr + g * stride_dg + offs_n, mask=g_mask, other=0.0)
                m = m.to(tl.float32) - BIAS * d
                acc += part * d[None, :] + a_sum[:, None] * m[None, :]
            else:
                if OFFSET == 1:
                    z = tl.load(off_ptr + g * stride_dg + offs_n, mask=g_mask, other=0)
                    z = z.to(tl.float32) + BIAS
                else:
                    z = tl.full((BLOCK_N,), 8.0 + BIAS, tl.float32)
                acc += (part - a_sum[:, None] * z[None, :]) * d[None, :]
    out = out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_splits_kernel(out_ptr, part_ptr, num_splits, MN, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] in split order (deterministic: no atomics)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
