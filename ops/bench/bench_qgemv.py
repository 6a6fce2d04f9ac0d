"""Weight-kernel microbenchmark: the q4/q8 block kernels (kernels/cpu/qgemv.cpp) against an fp32
dense matmul and torch's int4pack kernel, on the default model's matrix shapes, at 1, 8 and 32
rows (`--rows` for others: past 32 the float op multiplies dequantized tiles by BLAS; the bf16
op is timed past 16), one thread. Every method of one (shape, rows) is timed in the same
interleaved rounds, so a busy neighbour slows them alike; medians of wall and thread-CPU
microseconds.

    python -m ops.bench.bench_qgemv [--rounds 40] [--json out.json]
    python -m ops.bench.bench_qgemv --rows 33 128 --matrices gate_up_proj lm_head --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.qgemm_bf16 import bf16_gemm_available, bf16_linear
from kernels.qgemv import pack_q4_blocks, q4_dequantize, q4_linear, q8_dequantize, q8_linear
from kernels.qgemv_i8 import int8_kernels_available, q4_linear_i8, q8_linear_i8
from runtime.quant.linear import Int4Linear

# (name, out, in): SmolLM2-135M's fused projections and its tied lm_head (Q8_0 in the file)
SHAPES = [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576),
          ("down_proj", 576, 1536), ("lm_head", 49152, 576)]
ROWS = (1, 8, 32)


def methods(out_f: int, in_f: int, gen: torch.Generator) -> dict[str, Callable]:
    """name -> f(x) for one [out, in] matrix: the same random weights in every format."""
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    groups = in_f // 32
    codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=gen)
    qs = pack_q4_blocks(codes)
    d = (torch.rand(out_f, groups, generator=gen) * 0.01).half()
    m = (-8 * d.float()).half()
    out: dict[str, Callable] = {"fp32 F.linear": lambda x: F.linear(x, w)}
    if out_f == 49152:  # the lm_head: Q8_0 in the file
        q8 = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
        out["q8 kernel (Q8_0)"] = lambda x: q8_linear(x, q8, d)
        if int8_kernels_available():
            out["q8 kernel, int8 x (VNNI)"] = lambda x: q8_linear_i8(x, q8, d)
            out["q8 kernel, int8x2 x (VNNI)"] = lambda x: q8_linear_i8(x, q8, d, limbs=2)
        if bf16_gemm_available():  # BlockLinear's bf16 path: a bf16 copy kept while busy
            w8 = q8_dequantize(q8, d).bfloat16()
            out["q8 bf16 copy (bf16 x)"] = lambda x: bf16_linear(x, w8)
        out["q8 dequant + F.linear"] = lambda x: F.linear(x, q8_dequantize(q8, d))
        return out
    out["q4 kernel (Q4_1, g32 fp16)"] = lambda x: q4_linear(x, qs, d, m, 32)
    if int8_kernels_available():
        out["q4 kernel, int8 x (VNNI)"] = lambda x: q4_linear_i8(x, qs, d, m)
        out["q4 kernel, int8x2 x (VNNI)"] = lambda x: q4_linear_i8(x, qs, d, m, limbs=2)
    if bf16_gemm_available():
        w4 = q4_dequantize(qs, d, m, 32).bfloat16()
        out["q4 bf16 copy (bf16 x)"] = lambda x: bf16_linear(x, w4)
    out["q4 dequant + F.linear"] = lambda x: F.linear(x, q4_dequantize(qs, d, m, 32))
    ours = Int4Linear.from_float(w, group_size=128, layout="q4_blocks")
    torch_pack = Int4Linear.from_float(w, group_size=128, layout="cpu_int4pack")
    out["tessera int4 g128 (q4 kernel)"] = ours
    out["torch int4pack g128 (bf16 x)"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), torch_pack.weight_packed, 64 if in_f % 128 else 128,
        torch_pack._scales_and_zeros(64 if in_f % 128 else 128)).float()
    return out


def measure(fns: dict[str, Callable], x: torch.Tensor, rounds: int) -> dict[str, dict]:
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn(x)  # warm: first-use costs (page faults, packing) are not the steady state
    for _ in range(rounds):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn(x)
            cpu[name].append((time.thread_time() - c0) * 1e6)
            wall[name].append((time.perf_counter() - t0) * 1e6)
    return {k: {"wall_us": statistics.median(wall[k]), "cpu_us": statistics.median(cpu[k])}
            for k in fns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", help="write the medians here too")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--matrices", nargs="+", default=[n for n, _, _ in SHAPES],
                        choices=[n for n, _, _ in SHAPES])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, out_f, in_f in SHAPES:
        if name not in args.matrices:
            continue
        fns = methods(out_f, in_f, gen)
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen)
            res = measure({k: f for k, f in fns.items() if rows > 16 or "bf16" not in k}, x,
                          args.rounds)
            base = res["fp32 F.linear"]["cpu_us"]
            for method, r in res.items():
                results.append({"matrix": name, "out": out_f, "in": in_f, "rows": rows,
                                "method": method, **r, "vs_fp32_cpu": base / r["cpu_us"]})
                print(f"| {name} {out_f}x{in_f} | {rows} | {method} | {r['wall_us']:,.0f} | "
                      f"{r['cpu_us']:,.0f} | {base / r['cpu_us']:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
