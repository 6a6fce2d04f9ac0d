"""Compile every variant of the Triton matmuls (W4A16, block-FP8, the FP8 quantizer) that the
launchers in kernels/triton/launch_gemm.py use, for sm_90, without a GPU (as
triton_compile_sm90.py does for the attention kernels). Run as a script (TRITON_INTERPRET
unset); prints one "ok" line per variant and exits non-zero on the first failure, or when a
K loop was not software-pipelined (no cp.async) or the FP8 dot is not on wgmma."""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kernels.triton import fp8_block, w4a16
from kernels.triton.launch_gemm import fp8_config, w4a16_config

TARGET = GPUTarget("cuda", 90, 32)
W4A16_ROWS = (1, 32, 64, 128)  # one per config of w4a16_config
FP8_ROWS = (1, 32, 64, 512)  # and of fp8_config


def _build(fn, signature: dict[str, str], constexprs: dict[str, object], warps: int,
           stages: int = 3) -> Any:
    """Compiled as a launch with 16-aligned pointers and sizes and strides divisible by 16
    would be (triton specializes such arguments): the case the shapes that matter hit, and
    the one whose loads vectorize and pipeline."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    aligned = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in signature}
    return compile(ASTSource(fn, signature=sig, constexprs=constexprs, attrs=aligned),
                   target=TARGET, options={"num_warps": warps, "num_stages": stages})


def _w4a16(m: int, group: int, offset: int, split: bool, scale: str, act: str = "*bf16") -> None:
    cfg = dict(w4a16_config(m))
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    ints = ["M", "N", "K", "num_groups", "steps_per_split", "stride_xm", "stride_qk",
            "stride_dg", "stride_om", "stride_os"]
    sig = {"out_ptr": "*fp32" if split else act, "x_ptr": act, "qt_ptr": "*u8",
           "d_ptr": scale, "off_ptr": {0: scale, 1: "*u8", 2: scale}[offset],
           **{n: "i32" for n in ints}}
    bias = (dict(MAGIC=0x4300, UNBIAS=0.0, BIAS=128.0) if act == "*bf16"
            else dict(MAGIC=0x6400, UNBIAS=1024.0, BIAS=0.0))  # launch_gemm._CODE_BIAS
    kernel = _build(w4a16.w4a16_kernel, sig, dict(GROUP=group, STEP=128, OFFSET=offset, **bias,
                                                  SPLIT=split, DOT_F32=False, **cfg),
                    warps, stages)
    assert "cp.async" in kernel.asm["ptx"], ("w4a16 K loop not pipelined", m, group)


def main() -> int:
    for m in W4A16_ROWS:
        for group, offset, scale in ((32, 0, "*bf16"), (128, 1, "*bf16"), (32, 2, "*fp16")):
            _w4a16(m, group, offset, m <= 64, scale)
            print("ok w4a16", m, group, offset, scale, flush=True)
    _w4a16(1, 128, 1, True, "*bf16", act="*fp16")
    print("ok w4a16 fp16 activations", flush=True)
    _build(w4a16.reduce_splits_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32",
                                        "num_splits": "i32", "MN": "i32"}, dict(BLOCK=1024), 4)
    print("ok reduce_splits", flush=True)
    _build(fp8_block.quant_fp8_groups_kernel, {
        "q_ptr": "*u8", "s_ptr": "*fp32", "x_ptr": "*bf16", "K": "i32", "stride_xm": "i32",
        "stride_qm": "i32", "stride_sm": "i32"}, dict(GROUP=128, SOFT_FP8=False), 1)
    print("ok quant_fp8_groups", flush=True)
    for m in FP8_ROWS:
        for scale_rows in (128, 1):
            cfg = dict(fp8_config(m))
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            ints = ["M", "N", "K", "stride_am", "stride_asm", "stride_bn", "stride_bsn",
                    "stride_bsk", "stride_om"]
            kernel = _build(fp8_block.fp8_block_matmul_kernel, {
                "out_ptr": "*bf16", "a_ptr": "*u8", "as_ptr": "*fp32", "b_ptr": "*u8",
                "bs_ptr": "*fp32", **{n: "i32" for n in ints}},
                dict(SCALE_ROWS=scale_rows, BLOCK_K=128, DOT_F32=False, **cfg), warps, stages)
            ptx = kernel.asm["ptx"]
            assert "cp.async" in ptx, ("fp8 K loop not pipelined", m)
            assert m < 64 or "wgmma" in ptx, ("fp8 dot not on wgmma", m)
            print("ok fp8_block_matmul", m, scale_rows, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
