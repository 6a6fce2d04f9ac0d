"""Page gather + decode cost per KV format at decode-shaped sizes, one layer's K (or V).

    python3 -m ops.bench.bench_kv_gather

Times what decode attention does per layer and per K/V before its matmuls: gather every
(head, page) row of the batch and turn it into float32. fp32 pages are only gathered; bf16
pages are gathered and cast; fp8 pages are gathered and bit-decoded by the C++ op
(`kernels/cpu/e4m3_gather.cpp`) or, without it, by the same arithmetic in torch ops.
Medians of many calls; the default model's shape (3 KV heads, head_dim 64, pages of 16).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kernels import kv_fp8
from kernels.cpu_ops import native as cpu_ops
from kernels.paged_attention import _page_rows

HEADS, PAGE, DIM = 3, 16, 64


def median_us(fn, *args, repeats: int = 50) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=353)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(HEADS, args.pages, PAGE, DIM)
    caches = {"fp32": x, "bf16": x.bfloat16(),
              "fp8": x.to(torch.float8_e4m3fn).view(torch.uint8)}
    native = cpu_ops()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {args.threads} threads, "
          f"C++ op {'built' if native is not None else 'unavailable'}")
    print("| batch x pages | elements | fp32 us | bf16 us | fp8 C++ us | fp8 torch ops us |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for batch, pages in [(1, 3), (1, 12), (4, 11), (16, 13), (32, 13)]:
        table = torch.randint(0, args.pages, (batch, pages), generator=gen)
        rows = _page_rows(x, table)
        flat = {k: c.view(HEADS * args.pages, PAGE * DIM) for k, c in caches.items()}
        t32 = median_us(lambda f, r: f.index_select(0, r), flat["fp32"], rows)
        tbf = median_us(lambda f, r: f.index_select(0, r).float(), flat["bf16"], rows)
        tnat = (median_us(native.gather_e4m3_rows, flat["fp8"], rows)
                if native is not None else float("nan"))
        tref = median_us(kv_fp8.ref_gather_e4m3_rows, flat["fp8"], rows)
        print(f"| {batch} x {pages} | {rows.numel() * PAGE * DIM:,} | {t32:.0f} | {tbf:.0f} | "
              f"{tnat:.0f} | {tref:.0f} |")


if __name__ == "__main__":
    main()
