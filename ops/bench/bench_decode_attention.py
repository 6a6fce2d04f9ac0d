"""Decode attention per KV format: the C++ op (pages read in place) vs its torch twin.

    python3 -m ops.bench.bench_decode_attention

One layer of the default model's shape (9 query heads over 3 KV heads, head_dim 64, pages of
16), decode batches of `batch` sequences with `context` tokens each on shuffled pages. The
torch twin gathers every page into a float copy and runs batched matmuls; the C++ op reads
each K/V row in its storage format (fp8: e4m3 bytes and a bf16 scale per token and head).
`fp8-rot` is fp8 stored Hadamard-rotated (`kernels/hadamard.py`): the op rotates q and the
output per query head; its `store` column times writing one new token per sequence (the
rotation is paid there too), against plain fp8's. Formats and paths are interleaved; minimum
and median of many calls, microseconds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kernels.cpu_ops import native
from kernels.paged_attention import ref_paged_decode_attention
from kernels.store_kv import ref_store_kv, store_kv

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8,
           "fp8-rot": torch.uint8}


def _layer(fmt: str, batch: int, context: int, gen: torch.Generator):
    per_seq = -(-context // PAGE)
    pages = batch * per_seq + 1
    k = torch.empty(KV_HEADS, pages, PAGE, DIM, dtype=FORMATS[fmt])
    v = torch.empty_like(k)
    scales = (None, None)
    if FORMATS[fmt] == torch.uint8:
        scales = (torch.empty(KV_HEADS, pages, PAGE, dtype=torch.bfloat16),
                  torch.empty(KV_HEADS, pages, PAGE, dtype=torch.bfloat16))
    x = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=gen)
    ref_store_kv(x, x.flip(0), k, v, torch.arange(pages * PAGE), *scales,
                 hadamard=fmt == "fp8-rot")
    table = torch.randperm(pages, generator=gen)[: batch * per_seq].view(batch, per_seq)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM, generator=gen)
    return q, k, v, table, lens, scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=["1x128", "8x128", "32x128", "32x512"],
                    help="batch x context")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 is steadier on a loaded machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native()
    if ops is None:
        raise SystemExit("the C++ CPU ops are unavailable here (no compiler, or TESSERA_NATIVE=0)")
    gen = torch.Generator().manual_seed(0)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print("| batch x context | format | C++ op min / median us | torch twin min / median us | "
          "store min / median us |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        batch, context = (int(n) for n in size.split("x"))
        layers = {f: _layer(f, batch, context, gen) for f in FORMATS}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for fmt, (q, k, v, table, lens, scales) in layers.items():
                rot = fmt == "fp8-rot"
                for path, fn in (("op", ops.paged_decode_attention),
                                 ("twin", ref_paged_decode_attention)):
                    start = time.perf_counter()
                    fn(q, k, v, table, lens, DIM**-0.5, *scales, hadamard=rot)
                    times.setdefault((fmt, path), []).append(1e6 * (time.perf_counter() - start))
                new = q[:, :KV_HEADS].contiguous()  # one token per sequence: [batch, kv_heads, dim]
                slots = table[:, -1] * PAGE + (context - 1) % PAGE
                start = time.perf_counter()
                store_kv(new, new, k, v, slots, *scales, hadamard=rot)
                times.setdefault((fmt, "store"), []).append(1e6 * (time.perf_counter() - start))
        for fmt in FORMATS:
            op, twin, store = (times[(fmt, p)] for p in ("op", "twin", "store"))
            print(f"| {size} | {fmt} | {min(op):.0f} / {statistics.median(op):.0f} | "
                  f"{min(twin):.0f} / {statistics.median(twin):.0f} | "
                  f"{min(store):.0f} / {statistics.median(store):.0f} |")


if __name__ == "__main__":
    main()
