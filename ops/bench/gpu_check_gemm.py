"""The GPU check's matmul section (issue 30): the Triton W4A16 INT4 matmul (g32 symmetric, as
Kimi-K2 ships it) against bf16 `torch.matmul` at decode sizes M = 1..32 on Kimi/GLM shapes
(out x in 7168 x 2048 and 2048 x 7168), with its share of the measured copy bandwidth on the
bytes it must read (codes + scales); and the block-FP8 matmul (DeepSeek-V3 blocks, activation
quantization included and alone) against bf16 at prefill sizes. CUDA events, median, L2
flushed before every run (ops/bench/gpu_check.py's Timer).

Without CUDA it exits 2 at once; `--tiny` runs the same code on tiny shapes, on CPU in Triton's
interpreter when there is no GPU (wall-clock numbers, meaningless but the paths run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    int4_shapes: tuple[tuple[int, int], ...]  # (out N, in K)
    int4_rows: tuple[int, ...]
    fp8_shapes: tuple[tuple[int, int], ...]
    fp8_rows: tuple[int, ...]
    repeats: int


FULL = Sizes(2 << 30, ((7168, 2048), (2048, 7168)), (1, 2, 4, 8, 16, 32),
             ((7168, 7168), (2048, 7168), (7168, 2048)), (512, 2048, 4096), 20)
TINY = Sizes(1 << 20, ((160, 512),), (1, 4), ((160, 256),), (16,), 2)  # K 512: split 2
GROUP = 32


def _int4_weight(n: int, k: int, device: torch.device):
    from kernels.triton.int4_layout import repack_q4_blocks

    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    d = (torch.rand(n, k // GROUP, device=device) * 0.02 + 0.001).to(torch.bfloat16)
    return repack_q4_blocks(qs, d, None, GROUP)


def int4_table(timer, sizes: Sizes, bw: float, device: torch.device) -> None:
    from kernels.triton import launch_gemm

    print("\n| INT4 g32 W4A16 | out x in | M | splits | us | bf16 us | speed-up | GB/s on "
          "weights | share of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k in sizes.int4_shapes:
        w = _int4_weight(n, k, device)
        dense = torch.randn(n, k, dtype=torch.bfloat16, device=device)
        weight_bytes = w.qt.numel() + w.d.numel() * w.d.element_size()
        for m in sizes.int4_rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            ref_us = timer(partial(torch.matmul, x, dense.t()))
            chosen = launch_gemm.w4a16_num_splits(m, n, k, launch_gemm.num_sms(device))
            for splits in sorted({1, chosen}):  # split 1: what the reduce launch costs
                work = torch.empty(splits, m, n, device=device) if splits > 1 else None
                us = timer(partial(launch_gemm.w4a16_linear, x, w, split_k=splits, out=out,
                                   workspace=work))
                gbs = weight_bytes / (us * 1e-6)
                print(f"| g32 sym | {n} x {k} | {m} | {splits} | {us:.1f} | {ref_us:.1f} | "
                      f"{ref_us / us:.2f}x | {gbs / 1e9:.0f} | {gbs / bw:.0%} |")


def fp8_table(timer, sizes: Sizes, device: torch.device) -> None:
    from kernels.triton import launch_gemm

    print("\n| block-FP8 W8A8 | out x in | M | quant + matmul us | matmul us | bf16 us | "
          "speed-up (with quant) | TFLOPS (matmul) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in sizes.fp8_shapes:
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device) & 0xF7  # no NaN
        w_scale = torch.rand(-(-n // 128), -(-k // 128), device=device) * 1e-3 + 1e-4
        dense = torch.randn(n, k, dtype=torch.bfloat16, device=device)
        for m in sizes.fp8_rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            q, s = launch_gemm.quant_fp8_groups(x)
            full_us = timer(partial(launch_gemm.fp8_block_linear, x, w, w_scale))
            mm_us = timer(partial(launch_gemm.fp8_block_matmul, q, s, w, w_scale))
            ref_us = timer(partial(torch.matmul, x, dense.t()))
            tflops = 2 * m * n * k / (mm_us * 1e-6) / 1e12
            print(f"| 128x128 / 1x128 | {n} x {k} | {m} | {full_us:.1f} | {mm_us:.1f} | "
                  f"{ref_us:.1f} | {ref_us / full_us:.2f}x | {tflops:.0f} |")


def main(argv: list[str] | None = None) -> int:
    from ops.bench.gpu_check import check_device

    checked = check_device("gpu_check_gemm", __doc__, argv)
    if checked is None:
        return 2
    args, device = checked
    cuda = device.type == "cuda"
    from ops.bench.gpu_check import Timer, copy_bandwidth

    sizes = TINY if args.tiny else FULL
    timer = Timer(device, sizes.repeats)
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"## GPU check, matmuls: {name}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}, {stamp}")
    bw = copy_bandwidth(timer, sizes.copy_bytes)
    print(f"copy bandwidth (read + write, {sizes.copy_bytes >> 20} MiB copy_): {bw / 1e9:.0f} GB/s")
    int4_table(timer, sizes, bw, device)
    fp8_table(timer, sizes, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
