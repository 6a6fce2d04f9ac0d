"""The machine instructions of the Triton decode attention kernel for an H100/H200 (sm_90),
read without a GPU: each page format's decode variant at its launch defaults is compiled as a
launch would specialize it (16-aligned pointers, strides divisible by 16), disassembled with
the `cuobjdump` triton ships, and its instructions counted by class. On the H200 (RESULTS.md,
GPU) FP8 pages were paced by these counts, not by memory: one F2F per element converts codes
before the bf16 dot, and the BF16 variant has none. Read it before spending device time.

`python3 -m ops.bench.sass_mix` (TRITON_INTERPRET unset; the `cuda` extra; exits with one line
where triton or its cuobjdump is missing).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime.extras import require_extra

CLASSES = ("F2F", "F2FP", "I2F", "LDS", "LDSM", "LDGSTS", "HMMA", "IMAD", "LOP3", "PRMT",
           "FMUL", "FFMA")
_INTS = ["num_seqs", "num_heads", "stride_qt", "stride_qh", "stride_kh", "stride_kp",
         "stride_ko", "stride_vh", "stride_vp", "stride_vo", "stride_sh", "stride_sp",
         "stride_bt", "stride_ot", "stride_oh", "stride_os"]


def _cuobjdump() -> Path | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.is_file() else None


def compile_attention(fmt: str, q: str = "*bf16", split: bool = False, group: int = 4,
                      dim: int = 128, block_m: int = 16, dot_f32: bool = False) -> Any:
    """`paged_attention_kernel` for sm_90 as a launch specializes it (16-aligned pointers,
    strides divisible by 16: without these hints the page loads compile scalar and
    unpipelined, which no launch sees): `fmt`'s pages ("bf16", "fp16", "fp8", "int8"), query
    type `q`, the launcher's tile (`decode_tile_n` for decode, block_m 16), rotation and
    smoothing on for 1-byte pages. Returns triton's compiled kernel (`.asm["ptx"]`, `["cubin"]`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import paged_attention
    from kernels.triton.launch import decode_tile_n

    quant = {"fp8": 1, "int8": 2}.get(fmt, 0)
    kv = {"bf16": "*bf16", "fp16": "*fp16", "fp8": "*u8", "int8": "*i8"}[fmt]
    sig = {"out_ptr": "*fp32" if split else q, "lse_ptr": "*fp32", "q_ptr": q, "k_ptr": kv,
           "v_ptr": kv, "ks_ptr": "*bf16", "vs_ptr": "*bf16", "block_table_ptr": "*i64",
           "seq_lens_ptr": "*i64", "cu_q_ptr": "*i32", "valid_ptr": "*i32", "qs_ptr": "*fp32",
           "os_ptr": "*fp32", "sm_scale": "fp32", "inv_sqrt_dim": "fp32",
           **{n: "i64" if n in ("stride_kh", "stride_vh") else "i32" for n in _INTS}}
    tile = decode_tile_n(quant != 0) if block_m == 16 else (64 if quant else 32)
    consts = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=dim, PAGE_SIZE=16, BLOCK_M=block_m,
                  BLOCK_Q=block_m // group, TILE_N=tile, KV_QUANT=quant, HAS_VALID=True,
                  SPLIT=split, DOT_F32=dot_f32, ROTATE=quant != 0, Q_SCALE=quant != 0,
                  O_SCALE=quant != 0, LOG2_D=dim.bit_length() - 1)
    fn = paged_attention.paged_attention_kernel
    aligned = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
               if v.startswith("*") or k.startswith("stride_")}
    src = ASTSource(fn, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=aligned)
    return compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 2})


def instruction_mix(cubin: bytes, cuobjdump: Path) -> collections.Counter[str]:
    """Opcode (without modifiers) -> count over the cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)
    return collections.Counter(ops)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sass_mix: unset TRITON_INTERPRET (this compiles for the GPU)", file=sys.stderr)
        return 2
    require_extra("cuda", "triton", what="python3 -m ops.bench.sass_mix")
    tool = _cuobjdump()
    if tool is None:
        print("sass_mix: this triton ships no cuobjdump (triton/backends/nvidia/bin)",
              file=sys.stderr)
        return 2
    print("| decode attention, sm_90 | instructions | " + " | ".join(CLASSES) + " |")
    print("|---|---|" + "---|" * len(CLASSES))
    for fmt in ("bf16", "fp8", "int8"):
        mix = instruction_mix(compile_attention(fmt).asm["cubin"], tool)
        print(f"| {fmt} | {sum(mix.values())} | " + " | ".join(str(mix[c]) for c in CLASSES)
              + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
