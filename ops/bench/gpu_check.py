"""The GPU check's measurements (run by ops/bench/gpu_check.sh): copy bandwidth, a bf16 matmul,
then each Triton paged-KV kernel timed (CUDA events, median, L2 flushed before every run) with
its share of the measured copy bandwidth, at Llama-3.1-8B shapes (32 query heads, 8 KV heads,
head 128, page 16), batch 32-64 x 4-8k context.

`--tiny` runs the same code paths on tiny shapes; with TRITON_INTERPRET=1 and no GPU it runs
them on CPU in Triton's interpreter (wall-clock timing), to catch bugs before a GPU run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.extras import require_extra

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16  # Llama-3.1-8B attention, one layer


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    store_tokens: tuple[int, ...]
    tag_batch: int
    tag_context: int
    repeats: int


FULL = Sizes(2 << 30, 8192, (32, 64), (4096, 8192), (64, 4096), 64, 8192, 20)
TINY = Sizes(1 << 20, 128, (2,), (48,), (8,), 4, 64, 2)


def check_device(name: str, description: str | None, argv: list[str] | None,
                 parser: argparse.ArgumentParser | None = None,
                 ) -> tuple[argparse.Namespace, torch.device] | None:
    """A GPU check's start: its `--tiny` flag (added to `parser`, with the check's own flags)
    parsed, and the device it measures (CUDA, or the CPU with Triton's interpreter for
    `--tiny`); None, said on stderr, where neither applies. Call it before importing any Triton
    kernel module: TRITON_INTERPRET is read at import."""
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter check)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print(f"{name}: no CUDA device; nothing measured (--tiny runs the interpreter)",
              file=sys.stderr)
        return None
    require_extra("cuda", "triton", what=name)
    if not cuda and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args, torch.device("cuda" if cuda else "cpu")


class Timer:
    """Median time of fn() in microseconds; on CUDA by events with L2 flushed before each run."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(512 << 20 if self.cuda else 1 << 16, dtype=torch.uint8,
                                 device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up: compiles
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Bytes read + written per second of a device-to-device copy_."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6)


def matmul_tflops(timer: Timer, n: int) -> float:
    dtype = torch.bfloat16 if timer.cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=timer.device)
    b = torch.randn(n, n, dtype=dtype, device=timer.device)
    us = timer(lambda: a @ b)
    return 2 * n**3 / (us * 1e-6) / 1e12


def _pool(fmt: str, num_pages: int, device: torch.device):
    """Random K/V pages in `fmt` (valid codes; scales near their real range)."""
    shape = (KV_HEADS, num_pages, PAGE, DIM)
    if fmt in ("bf16", "fp16"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
        return (torch.randn(shape, dtype=dtype, device=device),
                torch.randn(shape, dtype=dtype, device=device), None, None)
    k = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    v = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    if fmt == "fp8":  # e4m3 bytes without the NaN codes 0x7f / 0xff
        k, v = (x.view(torch.uint8) & 0xF7 for x in (k, v))
    ks = (torch.rand(shape[:3], device=device) * 0.02 + 0.001).to(torch.bfloat16)
    vs = (torch.rand(shape[:3], device=device) * 0.02 + 0.001).to(torch.bfloat16)
    return k, v, ks, vs


def kv_bytes(fmt: str, tokens: int) -> int:
    """KV bytes a decode step reads: K and V, scales included."""
    per = DIM * (2 if fmt in ("bf16", "fp16") else 1) + (0 if fmt in ("bf16", "fp16") else 2)
    return tokens * 2 * KV_HEADS * per


def time_decode(timer: Timer, launch, fmt: str, batch: int, context: int,
                splits: int, **config: object) -> float:
    device = timer.device
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq
    k, v, ks, vs = _pool(fmt, num_pages, device)
    table = torch.randperm(num_pages, device=device).view(batch, pages_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device=device)
    out = torch.empty(batch, HEADS * DIM, dtype=torch.bfloat16, device=device)
    work = None
    if splits > 1:
        work = (torch.empty(batch, HEADS, splits, DIM, device=device),
                torch.empty(batch, HEADS, splits, device=device))
    # hadamard and smoothing off: their prologue and epilogue are a fixed cost per program
    return timer(lambda: launch.paged_attention(q, k, v, table, lens, cu, DIM**-0.5, ks, vs,
                                                num_splits=splits, out=out, workspace=work,
                                                max_seqlen_q=1, **config))


def time_store(timer: Timer, launch, fmt: str, tokens: int) -> float:
    device = timer.device
    num_pages = -(-tokens // PAGE) * 2
    k, v, ks, vs = _pool(fmt, num_pages, device)
    x = torch.randn(tokens, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(num_pages * PAGE, device=device)[:tokens]
    quant = fmt in ("fp8", "int8")
    smooth = [torch.rand(KV_HEADS, DIM, device=device) + 0.5 if quant else None
              for _ in range(3)]
    return timer(lambda: launch.store_kv(x, x, k, v, slots, ks, vs, quant, *smooth))


def time_tags(timer: Timer, launch, batch: int, context: int) -> float:
    device = timer.device
    pages = context // PAGE
    num_pages = batch * pages
    table = torch.randperm(num_pages, device=device).view(batch, pages)
    tags = torch.randint(1, 100, (num_pages,), device=device)
    owners = torch.randint(1, 5, (num_pages,), device=device)
    refs = torch.ones(num_pages, dtype=torch.int64, device=device)
    exp_tags, exp_owners = tags[table].contiguous(), owners[table].contiguous()
    counts = torch.full((batch,), pages, dtype=torch.int32, device=device)
    return timer(lambda: launch.verify_pages(table, table, exp_tags, exp_owners, counts, tags,
                                             owners, refs))


# (tile_n, num_warps, num_stages) per page format, the default (`decode_tile_n`) first
SWEEP = {"bf16": [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 4, 1), (128, 8, 2)],
         "fp8": [(128, 4, 2), (64, 4, 2), (256, 4, 2), (256, 8, 2), (128, 4, 1), (128, 2, 2)],
         "int8": [(128, 4, 2), (64, 4, 2), (256, 4, 2), (256, 8, 2), (128, 4, 1)]}


def sweep(timer: Timer, launch, sizes: Sizes, bw: float, sms: int) -> None:
    """Decode attention at the largest batch and context over launch configs (tuning), with
    the default split count and with one split."""
    batch, context = sizes.batches[-1], sizes.contexts[-1]
    splits = launch.decode_num_splits(batch, KV_HEADS, sms)
    print(f"\n| decode attention config, {batch} x {context} | tile | warps | stages | splits | "
          "us | GB/s | share of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt, configs in SWEEP.items():
        for tile, warps, stages in configs:
            for n in sorted({1, splits}):
                us = time_decode(timer, launch, fmt, batch, context, n, tile_n=tile,
                                 num_warps=warps, num_stages=stages)
                gbs = kv_bytes(fmt, batch * context) / (us * 1e-6)
                print(f"| {fmt} | {tile} | {warps} | {stages} | {n} | {us:.1f} | "
                      f"{gbs / 1e9:.0f} | {gbs / bw:.0%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true",
                        help="only the decode attention launch configs (tuning)")
    checked = check_device("gpu_check", __doc__, argv, parser)
    if checked is None:
        return 2
    args, device = checked
    from kernels.triton import launch

    sizes = TINY if args.tiny else FULL
    timer = Timer(device, sizes.repeats)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if timer.cuda else 132
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"## GPU check: {name}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}, {stamp}")
    bw = copy_bandwidth(timer, sizes.copy_bytes)
    print(f"copy bandwidth (read + write, {sizes.copy_bytes >> 20} MiB copy_): {bw / 1e9:.0f} GB/s")
    if args.sweep:
        sweep(timer, launch, sizes, bw, sms)
        return 0
    print(f"bf16 matmul {sizes.matmul}^3: {matmul_tflops(timer, sizes.matmul):.0f} TFLOPS")

    print("\n| decode attention | batch | context | splits | us | GB/s | share of copy |")
    print("|---|---|---|---|---|---|---|")
    decode_us: dict[tuple[str, int, int], float] = {}
    for batch in sizes.batches:
        for context in sizes.contexts:
            for fmt in ("bf16", "fp8", "int8"):
                best = None
                for splits in sorted({1, launch.decode_num_splits(batch, KV_HEADS, sms)}):
                    us = time_decode(timer, launch, fmt, batch, context, splits)
                    gbs = kv_bytes(fmt, batch * context) / (us * 1e-6)
                    print(f"| {fmt} | {batch} | {context} | {splits} | {us:.1f} | "
                          f"{gbs / 1e9:.0f} | {gbs / bw:.0%} |")
                    best = us if best is None else min(best, us)
                decode_us[fmt, batch, context] = best
    print("\n| equal batch | FP8 speed-up over BF16 | INT8 speed-up over BF16 |")
    print("|---|---|---|")
    for batch in sizes.batches:
        for context in sizes.contexts:
            b16 = decode_us["bf16", batch, context]
            print(f"| {batch} x {context} | {b16 / decode_us['fp8', batch, context]:.2f}x | "
                  f"{b16 / decode_us['int8', batch, context]:.2f}x |")

    print("\n| store (quantize + rotate + smooth) | tokens | us | GB/s | share of copy |")
    print("|---|---|---|---|---|")
    for fmt in ("bf16", "fp8", "int8"):
        for tokens in sizes.store_tokens:
            us = time_store(timer, launch, fmt, tokens)
            moved = tokens * 2 * KV_HEADS * DIM * 2 + kv_bytes(fmt, tokens)  # read + write
            print(f"| {fmt} | {tokens} | {us:.1f} | {moved / us / 1e3:.0f} | "
                  f"{moved / (us * 1e-6) / bw:.0%} |")
    us = time_tags(timer, launch, sizes.tag_batch, sizes.tag_context)
    print(f"\ntag pass, {sizes.tag_batch} x {sizes.tag_context} "
          f"({sizes.tag_batch * sizes.tag_context // PAGE} pages): {us:.1f} us")

    print("\nthe engine end to end (decode tok/s, graphs on/off, the tag pass's cost): "
          "ops/bench/gpu_check_engine.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
