"""Write new tokens' K and V into their page slots in Triton, quantizing for 1-byte pages.

The same arithmetic as the torch twin (`kernels/store_kv.py`), in the same order, so codes and
scales match it bit for bit: (x - shift) / divisor, the Sylvester Walsh-Hadamard butterfly
(`kernels/hadamard.py`), amax / QMAX rounded to bf16 first and the row divided by the rounded
scale (IEEE division), clamped to +-448 (e4m3fn) or rounded to nearest even and clamped to
+-127 (int8). NaN becomes 0, +-inf the clamp. Launcher: `kernels/triton/launch.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to nearest, ties to even
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _fwht(x, inv_sqrt_dim, ROWS: tl.constexpr, DIM: tl.constexpr, LOG2_DIM: tl.constexpr):
    # each stage on every row: pairs (a, b) H apart within blocks of 2H -> (a + b, a - b).
    # NOTE: the stage is written inline, not as a jit helper: the interpreter re-patches
    # triton.language on every nested call, which was most of a store's time there
    for i in tl.static_range(LOG2_DIM):
        y = tl.permute(tl.reshape(x, [ROWS, DIM // (2 << i), 2, 1 << i]), [0, 1, 3, 2])
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, DIM])
    return x * inv_sqrt_dim


@triton.jit
def _bf16_bits(x):
    """float32 (finite) -> its bf16 rounding to nearest even, as the bf16 bit pattern (uint16).
    Integer arithmetic, not a cast: triton 3.9's interpreter truncates fp32 -> bf16 casts."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _e4m3_code(y):
    """float32 in [-448, 448] -> e4m3fn byte, rounded to nearest even (as torch's cast).
    Integer arithmetic: the interpreter's fp32 -> fp8 cast rounds some values otherwise."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    # normal range (a >= 2**-6): keep 3 mantissa bits, ties to even, rebias 127 -> 7
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: multiples of 2**-9 (a * 512 is exact), 8 lands on the first normal
    sub = ((a * 512.0 + _RNE_MAGIC) - _RNE_MAGIC).to(tl.uint32)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _store_rows(x, row_ptrs, scale_ptrs, ok, offs, shift_ptr, divisor_ptr, inv_sqrt_dim,
                ROWS: tl.constexpr, DIM: tl.constexpr, LOG2_DIM: tl.constexpr,
                QUANT: tl.constexpr, ROTATE: tl.constexpr, HAS_SHIFT: tl.constexpr,
                HAS_DIVISOR: tl.constexpr):
    # x: [ROWS, DIM] (token, head) rows as given; row_ptrs [ROWS, DIM], scale_ptrs [ROWS];
    # ok [ROWS]: rows to write. QUANT: 0 cast to the page dtype, 1 e4m3, 2 int8.
    if QUANT == 0:
        if row_ptrs.dtype.element_ty == tl.bfloat16:  # rounded to nearest even, as torch
            x = x.to(tl.float32)
            bits = tl.where(x != x, 0x7FC0, _bf16_bits(x).to(tl.int32)).to(tl.uint16)
            tl.store(row_ptrs, bits.to(tl.bfloat16, bitcast=True), mask=ok[:, None])
        else:
            tl.store(row_ptrs, x.to(row_ptrs.dtype.element_ty), mask=ok[:, None])
    else:
        x = x.to(tl.float32)
        if HAS_SHIFT:
            x = x - tl.load(shift_ptr + offs)[None, :]
        if HAS_DIVISOR:
            x = tl.math.div_rn(x, tl.broadcast_to(tl.load(divisor_ptr + offs)[None, :],
                                                  [ROWS, DIM]))
        if ROTATE:
            x = _fwht(x, inv_sqrt_dim, ROWS, DIM, LOG2_DIM)
        qmax = 448.0 if QUANT == 1 else 127.0
        is_nan = x != x
        amax = tl.max(tl.where(is_nan, 0.0, tl.abs(x)), 1)
        amax = tl.where(tl.max(is_nan.to(tl.int32), 1) > 0, 0.0, amax)  # nan amax -> 0
        amax = tl.minimum(amax, 3.4028234663852886e38)  # inf amax -> float32 max
        scale_bits = _bf16_bits(tl.maximum(tl.math.div_rn(amax, tl.full([ROWS], qmax,
                                                                         tl.float32)), 1e-12))
        scale = (scale_bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        finite = tl.where(x == float("inf"), 2 * qmax, x)  # torch.nan_to_num's mapping
        finite = tl.where(is_nan, 0.0, tl.where(x == float("-inf"), -2 * qmax, finite))
        y = tl.math.div_rn(finite, tl.broadcast_to(scale[:, None], [ROWS, DIM]))
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:
            code = _e4m3_code(y)
        else:
            code = ((y + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int8)
        tl.store(row_ptrs, code, mask=ok[:, None])
        tl.store(scale_ptrs, scale_bits, mask=ok)  # scales passed as their uint16 view


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    k_shift_ptr, k_divisor_ptr, v_divisor_ptr, inv_sqrt_dim, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ch, stride_cp, stride_co,
    stride_sh, stride_sp,
    PAGE_SIZE: tl.constexpr, DIM: tl.constexpr, LOG2_DIM: tl.constexpr,
    QUANT: tl.constexpr, ROTATE: tl.constexpr, HAS_SHIFT: tl.constexpr,
    HAS_DIVISOR: tl.constexpr, HAS_V_DIVISOR: tl.constexpr, HAS_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # grid: (cdiv(tokens, BLOCK_T), kv_heads); K and V of BLOCK_T tokens of one head per
    # program. slot -1: padding, written nowhere. HAS_V False: one cache only (the
    # `store_kv_rows` op), k_* its rows, v_* unused.
    head = tl.program_id(1).to(tl.int64)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    slot = tl.where(ok, slot, 0)
    offs = tl.arange(0, DIM)
    page = slot // PAGE_SIZE
    row = head * stride_ch + page * stride_cp + (slot % PAGE_SIZE) * stride_co
    srow = head * stride_sh + page * stride_sp + slot % PAGE_SIZE
    k = tl.load(k_ptr + tok[:, None] * stride_kt + head * stride_kh + offs[None, :],
                mask=ok[:, None], other=0.0)
    _store_rows(k, k_cache_ptr + row[:, None] + offs[None, :], k_scale_ptr + srow, ok, offs,
                k_shift_ptr + head * DIM, k_divisor_ptr + head * DIM, inv_sqrt_dim, BLOCK_T,
                DIM, LOG2_DIM, QUANT, ROTATE, HAS_SHIFT, HAS_DIVISOR)
    if HAS_V:
        v = tl.load(v_ptr + tok[:, None] * stride_vt + head * stride_vh + offs[None, :],
                    mask=ok[:, None], other=0.0)
        _store_rows(v, v_cache_ptr + row[:, None] + offs[None, :], v_scale_ptr + srow, ok,
                    offs, k_shift_ptr, v_divisor_ptr + head * DIM, inv_sqrt_dim, BLOCK_T, DIM,
                    LOG2_DIM, QUANT, ROTATE, False, HAS_V_DIVISOR)


@triton.jit
def store_latent_kernel(
    x_ptr, cache_ptr, pe_cache_ptr, scale_ptr, slot_ptr, num_tokens,
    stride_xt, stride_cp, stride_co, stride_pp, stride_po, stride_sp,
    PAGE_SIZE: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # grid: (cdiv(tokens, BLOCK_T),). MLA latents [tokens, LORA + ROPE] into latent rows:
    # c_kv as QUANT says (0 the page dtype, 1 e4m3, 2 int8, one scale per token over c_kv),
    # k_pe through pe_cache_ptr (a float view of the row's tail: bf16 for 1-byte pages) as is.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    slot = tl.where(ok, slot, 0)
    page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
    offs_l = tl.arange(0, LORA)
    offs_r = tl.arange(0, ROPE)
    x_rows = x_ptr + tok[:, None] * stride_xt
    c_kv = tl.load(x_rows + offs_l[None, :], mask=ok[:, None], other=0.0)
    row = page * stride_cp + off * stride_co
    _store_rows(c_kv, cache_ptr + row[:, None] + offs_l[None, :],
                scale_ptr + page * stride_sp + off, ok, offs_l, x_ptr, x_ptr, 1.0, BLOCK_T,
                LORA, 0, QUANT, False, False, False)
    pe = tl.load(x_rows + LORA + offs_r[None, :], mask=ok[:, None], other=0.0)
    pe_row = page * stride_pp + off * stride_po
    _store_rows(pe, pe_cache_ptr + pe_row[:, None] + offs_r[None, :], scale_ptr, ok, offs_r,
                x_ptr, x_ptr, 1.0, BLOCK_T, ROPE, 0, 0, False, False, False)
