"""Compile every fused-MoE, MLA-decode and latent-store kernel variant the launchers use for
sm_90 without a GPU (as tests/kernels/triton_compile_sm90.py does for the paged-KV kernels).
Integer arguments equal to 1 are specialised by Triton (passed as constexprs): one variant of
each kernel compiles that way. Run as a script (TRITON_INTERPRET unset); one line per variant."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

from kernels.triton import fused_moe, mla_decode, store_kv
from tests.kernels.triton_compile_sm90 import _build

PTR = {"bf16": "*bf16", "fp8": "*u8", "int8": "*i8"}
MOE_INTS = ["N", "K", "num_valid", "a_row_div", "up_offset", "stride_am", "stride_asm", "stride_we",
            "stride_wn", "stride_wk", "stride_se", "stride_sn", "stride_sk", "stride_om"]
MLA_INTS = ["num_heads", "stride_qb", "stride_qh", "stride_kp", "stride_ko", "stride_pp",
            "stride_po", "stride_sp", "stride_psp", "stride_bt", "stride_ob", "stride_oh",
            "stride_os"]


def moe(fmt: int, swiglu: bool, block_m: int, ones: tuple[str, ...] = ()) -> None:
    w, s = {0: ("*bf16", "*bf16"), 1: ("*u8", "*fp32"), 2: ("*u8", "*bf16"),
            3: ("*u8", "*fp32")}[fmt]
    sig = {"out_ptr": "*bf16", "a_ptr": "*u8" if fmt == 3 else "*bf16", "as_ptr": "*fp32",
           "w_ptr": w, "ws_ptr": s, "wz_ptr": "*u8",
           "topk_w_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
           "num_post_pad_ptr": "*i32", **{n: "i32" for n in MOE_INTS if n not in ones}}
    _build(fused_moe.fused_moe_kernel, sig, dict(
        {n: 1 for n in ones}, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128 if fmt in (1, 3) else 64,
        GROUP_M=8 if block_m == 64 else 1, W_FORMAT=fmt, GROUP_K=32, HAS_ZEROS=fmt == 2,
        SWIGLU=swiglu, MUL_ROUTED=not swiglu, DOT_F32=False), 4)


def mla(kv: str, pe: str, split: bool, ones: tuple[str, ...] = ()) -> None:
    sig = {"out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32", "q_ptr": "*bf16",
           "kv_ptr": PTR[kv], "pe_ptr": PTR[pe], "ks_ptr": "*bf16", "pes_ptr": "*bf16",
           "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "sm_scale": "fp32",
           **{n: "i32" for n in MLA_INTS if n not in ones}}
    quant = {"bf16": 0, "fp8": 1, "int8": 2}
    _build(mla_decode.mla_decode_kernel, sig, dict(
        {n: 1 for n in ones}, LORA=512, ROPE=64, BLOCK_R=64, PAGE_SIZE=64, BLOCK_H=16,
        TILE_N=32 if quant[kv] else 16, KV_QUANT=quant[kv], PE_QUANT=quant[pe], SPLIT=split,
        DOT_F32=False), 4)


def latent_store(cache: str, quant: int) -> None:
    # 1-byte rows: codes through the cache pointer, the RoPE part through its bf16 view
    pe = "*bf16" if quant else cache
    names = ["num_tokens", "stride_xt", "stride_cp", "stride_co", "stride_pp", "stride_po",
             "stride_sp"]
    _build(store_kv.store_latent_kernel, {
        "x_ptr": "*bf16", "cache_ptr": cache, "pe_cache_ptr": pe, "scale_ptr": "*u16",
        "slot_ptr": "*i64", **{n: "i32" for n in names}},
        dict(PAGE_SIZE=64, LORA=512, ROPE=64, QUANT=quant, BLOCK_T=16), 4)


def main() -> int:
    for fmt in (0, 1, 2, 3):
        for swiglu, block_m in ((True, 16), (False, 64)):
            moe(fmt, swiglu, block_m)
            print("ok fused_moe", fmt, swiglu, block_m, flush=True)
    moe(2, True, 16, ones=("num_valid", "a_row_div", "N", "up_offset"))  # 1 row, width 1
    print("ok fused_moe ones", flush=True)
    for kv, pe, split in (("bf16", "bf16", False), ("fp8", "fp8", True), ("int8", "int8", False),
                          ("fp8", "bf16", True), ("int8", "bf16", False)):
        mla(kv, pe, split)
        print("ok mla", kv, pe, split, flush=True)
    mla("fp8", "fp8", True, ones=("num_heads",))
    print("ok mla ones", flush=True)
    for cache, quant in (("*bf16", 0), ("*u8", 1), ("*i8", 2)):
        latent_store(cache, quant)
        print("ok latent store", cache, quant, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
