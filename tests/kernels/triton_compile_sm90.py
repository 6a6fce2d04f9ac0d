"""Compile every Triton kernel variant the launchers use for an H100/H200 (sm_90) without a GPU:
Triton lowers to PTX and ptxas assembles a cubin on CPU. Run as a script (TRITON_INTERPRET
unset); prints one line per variant and exits non-zero on the first failure."""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kernels.triton import paged_attention, store_kv, verify_pages
from ops.bench.sass_mix import compile_attention

TARGET = GPUTarget("cuda", 90, 32)


def _build(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int) -> Any:
    """Compiled as a launch with 16-aligned pointers and strides divisible by 16 would be
    (triton specializes such arguments; without the hints the page loads compile scalar and
    unpipelined, which no launch sees)."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    aligned = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
               if v.startswith("*") or k.startswith("stride_")}
    src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=aligned)
    return compile(src, target=TARGET, options={"num_warps": warps})


def attention(fmt: str, q: str, split: bool, group: int, dim: int, block_m: int,
              dot_f32: bool = False) -> None:
    # the 1-byte formats with their rotation and smoothing fused (queries in, output out)
    kernel = compile_attention(fmt, q, split, group, dim, block_m, dot_f32)
    assert "cp.async" in kernel.asm["ptx"], ("page loads not pipelined", fmt, q, split)


def main() -> int:
    variants = [(fmt, q, split, group, dim, bm) for fmt in ("bf16", "fp16", "fp8", "int8")
                for q, split, group, dim, bm in [("*bf16", False, 4, 128, 16),
                                                 ("*bf16", True, 8, 64, 16),
                                                 ("*bf16", False, 1, 128, 64)]]
    variants.append(("int8", "*fp32", True, 4, 64, 16, True))  # fp32 queries: IEEE dots
    for v in variants:
        attention(*v)
        print("ok attention", *v, flush=True)
    for rotate in (False, True):
        _build(paged_attention.merge_splits_kernel, {
            "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "os_ptr": "*fp32",
            "num_splits": "i32", "num_heads": "i32", "inv_sqrt_dim": "fp32", "stride_ot": "i32",
            "stride_oh": "i32", "stride_pt": "i32", "stride_ph": "i32", "stride_ps": "i32"},
            dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, GROUP=4, ROTATE=rotate, O_SCALE=rotate,
                 LOG2_D=7), 4)
        print("ok merge", rotate, flush=True)
    for cache, quant, dim in (("*bf16", 0, 128), ("*u8", 1, 128), ("*i8", 2, 64)):
        names = ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ch", "stride_cp",
                 "stride_co", "stride_sh", "stride_sp"]
        _build(store_kv.store_kv_kernel, {
            "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
            "k_scale_ptr": "*u16", "v_scale_ptr": "*u16", "slot_ptr": "*i64",
            "k_shift_ptr": "*fp32", "k_divisor_ptr": "*fp32", "v_divisor_ptr": "*fp32",
            "inv_sqrt_dim": "fp32", "num_tokens": "i32", **{n: "i32" for n in names}},
            dict(PAGE_SIZE=16, DIM=dim, LOG2_DIM=dim.bit_length() - 1, QUANT=quant,
                 ROTATE=quant != 0, HAS_SHIFT=quant != 0, HAS_DIVISOR=quant != 0,
                 HAS_V_DIVISOR=quant != 0, HAS_V=quant != 2, BLOCK_T=16), 4)
        print("ok store", cache, quant, dim, flush=True)
    _build(verify_pages.verify_pages_kernel, {
        "valid_ptr": "*i32", "cause_ptr": "*i32", "page_table_ptr": "*i64",
        "exp_ids_ptr": "*i64", "exp_tags_ptr": "*i64", "exp_owners_ptr": "*i64",
        "num_entries_ptr": "*i32", "pool_tags_ptr": "*i64", "pool_owners_ptr": "*i64",
        "pool_refcounts_ptr": "*i64", "num_pages": "i32", "stride_pt": "i32",
        "stride_et": "i32", "stride_tt": "i32", "stride_ot": "i32"}, dict(BLOCK=512), 4)
    print("ok verify_pages", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
