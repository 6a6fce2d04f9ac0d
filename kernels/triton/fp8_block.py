"""Block-scaled FP8 matmul in Triton (DeepSeek-V3's W8A8 block format, SGLang's
`_w8a8_block_fp8_matmul`): e4m3 activations with one fp32 scale per token per 128 columns,
e4m3 weights [N, K] with one fp32 scale per 128 x 128 block (or per row and 128 columns,
tessera's expanded form), and the activation quantization as its own small kernel.

Each 128-wide K block's dot starts from zero and is added to the fp32 accumulator times its
two scales (the promotion DeepGEMM does on CUDA cores: Hopper's FP8 tensor-core accumulation
keeps fewer bits than fp32), so BLOCK_K is the scale group, 128. e4m3 travels as uint8 bytes
(tessera's storage) and is bitcast in the kernel. Launchers: `kernels/triton/launch_gemm.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.w4a16 import _tile

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)  # kernels/fp8.py _MIN_SCALE: an all-zero group never divides 0/0
F32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _e4m3_bits(v):
    """fp32 v (finite, |v| <= 448) -> its e4m3fn byte, round to nearest even, in integer ops:
    triton's interpreter converts to float8e4nv wrongly (126.5 -> 64, ties away from even;
    triton #8322 is the e5m2 twin), so the interpreter encodes this way."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = ((bits >> 31) << 7).to(tl.int32)
    a_bits = bits & 0x7FFFFFFF
    rounded = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)  # RNE to 3 mantissa bits
    normal = (rounded >> 20).to(tl.int32) - ((127 - 7) << 3)  # rebias 127 -> 7
    a = a_bits.to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # RNE to 2**-9 steps
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def quant_fp8_groups_kernel(q_ptr, s_ptr, x_ptr, K, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr, SOFT_FP8: tl.constexpr):
    """One (row, group) per program: s = max(amax / 448, 1e-12) in fp32 (`kernels.fp8.
    fp8_scale`), q = e4m3(clamp(x / s, +-448)) stored as its byte. NaN reads as 0 and +-inf as
    the largest finite fp32 (`ref_quant_fp8_groups`): no NaN code, whatever the input."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(x != x, 0.0, x)
    x = tl.minimum(tl.maximum(x, -F32_MAX), F32_MAX)
    amax = tl.max(tl.abs(x), axis=0)
    # IEEE division (div_rn) as torch divides: a plain `/` compiles to the GPU's approximate
    # division, whose codes differed from the twin's on an H200
    scale = tl.maximum(tl.math.div_rn(amax, tl.full([], FP8_MAX, tl.float32)), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(scale, [GROUP])), -FP8_MAX),
                   FP8_MAX)
    if SOFT_FP8:
        q = _e4m3_bits(q)
    else:
        q = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite on sm_89+
    tl.store(q_ptr + row * stride_qm + offs, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale)


@triton.jit
def _fp8_dot(a, b, DOT_F32: tl.constexpr):
    """a [BM, BK] @ b [BK, BN], both e4m3 bytes, -> fp32. DOT_F32 (the interpreter only):
    decoded to fp32 first (e4m3 -> bf16 is exact; the interpreter's fp8 dot is not trusted)."""
    a = a.to(tl.float8e4nv, bitcast=True)
    b = b.to(tl.float8e4nv, bitcast=True)
    if DOT_F32:
        a = a.to(tl.bfloat16).to(tl.float32)
        b = b.to(tl.bfloat16).to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def fp8_block_matmul_kernel(
    out_ptr, a_ptr, as_ptr, b_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_bsk, stride_om,
    SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    # out [M, N] = sum over K blocks kb of (a[:, kb] @ b[:, kb]^T) * as[:, kb] * bs[n // SCALE_ROWS,
    # kb]; SCALE_ROWS = 128 for DeepSeek-V3's weight_scale_inv, 1 for one scale per row.
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    as_rows = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_cols = bs_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        in_k = k < K
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & in_k[None, :], other=0)
        b = tl.load(b_cols + k[:, None], mask=in_k[:, None] & mask_n[None, :], other=0)
        a_s = tl.load(as_rows + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_cols + kb * stride_bsk, mask=mask_n, other=0.0)
        acc += _fp8_dot(a, b, DOT_F32) * a_s[:, None] * b_s[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
