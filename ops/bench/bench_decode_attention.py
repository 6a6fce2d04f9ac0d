"""Decode attention per KV format: the C++ op (pages read in place) vs its torch twin.

    python3 -m ops.bench.bench_decode_attention

One layer of the default model's shape (9 query heads over 3 KV heads, head_dim 64, pages of
16), decode batches of `batch` sequences with `context` tokens each on shuffled pages. The
torch twin gathers every page into a float copy and runs batched matmuls; the C++ op reads
each K/V row in its storage format (fp8: e4m3 bytes and a bf16 scale per token and head).
`fp8-rot` is fp8 stored Hadamard-rotated (`kernels/hadamard.py`): the op rotates q and the
output per query head; its `store` column times writing one new token per sequence (the
rotation is paid there too), against plain fp8's. `fp8-smooth` is this tree's default FP8
format: rotated, with a key shift and key/value channel scales (`runtime/kv/smoothing.py`)
applied inside the store and decode ops. `int8` and `int8-smooth` are the same for symmetric
INT8 pages (`kernels/int8.py`, the same bytes); `int8-smooth` is the served INT8 format. With
`--ref REF`, the C++ ops of that git ref are built
too (their sources alone, as a second extension) and its fp8 / fp8-rot ops are timed in the same
interleaved loop (`fp8@REF`, `fp8-rot@REF`): before and after in one run. Formats and paths are
interleaved; minimum and median of many calls, microseconds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kernels.cpu_ops import _SOURCES, _arch_flags, native
from kernels.paged_attention import ref_paged_decode_attention
from kernels.store_kv import ref_store_kv, store_kv

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8,
           "fp8-rot": torch.uint8, "fp8-smooth": torch.uint8, "int8": torch.int8,
           "int8-smooth": torch.int8}
REPO = Path(__file__).resolve().parents[2]


def _ref_ops(ref: str):
    """The C++ ops as they are at git `ref`, built from its sources under another name."""
    from torch.utils.cpp_extension import load

    files = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", ref,
                            "kernels/cpu/"], check=True, capture_output=True, text=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-attn-ref-"))
    digest = hashlib.sha256(ref.encode())
    for name in files.stdout.split():
        data = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{name}"], check=True,
                              capture_output=True).stdout
        (tmp / Path(name).name).write_bytes(data)
        digest.update(data)
    # NOTE: not qgemv.cpp: it registers a torch library namespace, which may exist only once
    sources = [str(tmp / s) for s in _SOURCES if (tmp / s).exists() and s != "qgemv.cpp"]
    return load(f"tessera_cpu_ops_ref_{digest.hexdigest()[:12]}", sources,
                extra_cflags=["-O3", *_arch_flags(), "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=False)


def _smoothing(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(KV_HEADS, DIM, generator=gen), torch.rand(KV_HEADS, DIM, generator=gen)
            + 0.5, torch.rand(KV_HEADS, DIM, generator=gen) + 0.5)


def _layer(fmt: str, batch: int, context: int, gen: torch.Generator):
    per_seq = -(-context // PAGE)
    pages = batch * per_seq + 1
    k = torch.empty(KV_HEADS, pages, PAGE, DIM, dtype=FORMATS[fmt])
    v = torch.empty_like(k)
    scales = (None, None)
    if FORMATS[fmt] in (torch.uint8, torch.int8):
        scales = (torch.empty(KV_HEADS, pages, PAGE, dtype=torch.bfloat16),
                  torch.empty(KV_HEADS, pages, PAGE, dtype=torch.bfloat16))
    x = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=gen)
    ref_store_kv(x, x.flip(0), k, v, torch.arange(pages * PAGE), *scales,
                 hadamard="-" in fmt)
    table = torch.randperm(pages, generator=gen)[: batch * per_seq].view(batch, per_seq)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM, generator=gen)
    return q, k, v, table, lens, scales


def _timed(times: dict, key: tuple[str, str], fn, *call_args) -> None:
    start = time.perf_counter()
    fn(*call_args)
    times.setdefault(key, []).append(1e6 * (time.perf_counter() - start))


def _store_old(old, x, k, v, slots, scales, rot) -> None:
    old.store_kv_rows(x, k, slots, scales[0], rot)
    old.store_kv_rows(x, v, slots, scales[1], rot)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=["1x128", "8x128", "32x128", "32x512"],
                    help="batch x context")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 is steadier on a loaded machine")
    ap.add_argument("--ref", default=None, help="git ref whose C++ ops run beside this tree's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native()
    if ops is None:
        raise SystemExit("the C++ CPU ops are unavailable here (no compiler, or TESSERA_NATIVE=0)")
    old = _ref_ops(args.ref) if args.ref else None
    gen = torch.Generator().manual_seed(0)
    smooth = _smoothing(gen)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print("| batch x context | format | C++ op min / median us | torch twin min / median us | "
          "store min / median us |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        batch, context = (int(n) for n in size.split("x"))
        layers = {f: _layer(f, batch, context, gen) for f in FORMATS}
        times: dict[tuple[str, str], list[float]] = {}

        timed = functools.partial(_timed, times)
        for _ in range(args.repeats):
            for fmt, (q, k, v, table, lens, scales) in layers.items():
                rot = "-" in fmt  # fp8-rot, fp8-smooth, int8-smooth
                shift, k_div, v_div = smooth if fmt.endswith("-smooth") else (None, None, None)
                attn_args = (q, k, v, table, lens, DIM**-0.5, *scales, rot)
                timed((fmt, "op"), ops.paged_decode_attention, *attn_args, k_div, v_div)
                timed((fmt, "twin"), ref_paged_decode_attention, *attn_args, k_div, v_div)
                if old is not None and fmt in ("fp8", "fp8-rot"):
                    timed((f"{fmt}@{args.ref}", "op"), old.paged_decode_attention, *attn_args)
                new = q[:, :KV_HEADS].contiguous()  # one token per sequence: [batch, kv_heads, dim]
                slots = table[:, -1] * PAGE + (context - 1) % PAGE
                timed((fmt, "store"), store_kv, new, new, k, v, slots, *scales, rot, shift, k_div,
                      v_div)
                if old is not None and fmt in ("fp8", "fp8-rot"):
                    timed((f"{fmt}@{args.ref}", "store"), _store_old, old, new, k, v, slots,
                          scales, rot)
        for fmt in dict.fromkeys(f for f, _ in times):  # first-seen order
            op, store = times[(fmt, "op")], times[(fmt, "store")]
            twin = times.get((fmt, "twin"))
            twin_s = f"{min(twin):.0f} / {statistics.median(twin):.0f}" if twin else "-"
            print(f"| {size} | {fmt} | {min(op):.0f} / {statistics.median(op):.0f} | {twin_s} | "
                  f"{min(store):.0f} / {statistics.median(store):.0f} |")


if __name__ == "__main__":
    main()
