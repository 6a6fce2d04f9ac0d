"""Tensor parallelism on CPU: decode tok/s of the default model at TP=2 (two processes, gloo,
one thread each) vs TP=1 (one process, one and two threads).

    python3 -m ops.bench.bench_tp --concurrency 1 8 --repeats 3

TP=1 runs first in this process, then the two ranks run as child processes (this process
idles meanwhile); each configuration repeats its runs and reports the median. The ranks also
time one gloo all-reduce of a decode step's hidden states ([concurrency, 576] float32), of
which a step of the default model runs 60 (after attention and after the MLP, 30 layers).
On a 2-core machine TP cannot win: the two ranks share the cores one process would use, and
each all-reduce is a round trip between processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ops.bench.bench_moe import decode_tok_s
from runtime import LLM

ROOT = Path(__file__).resolve().parents[2]


def measure(llm: LLM, concurrency: list[int], repeats: int, max_tokens: int
            ) -> dict[int, list[float]]:
    decode_tok_s(llm, 2, 4)  # warm-up
    return {c: [decode_tok_s(llm, c, max_tokens) for _ in range(repeats)] for c in concurrency}


def all_reduce_us(rows: int, hidden: int = 576, repeats: int = 200) -> float:
    import torch.distributed as dist

    x = torch.randn(rows, hidden)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from runtime.distributed import init_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel(args.rank, 2, f"file://{args.init_file}", backend="gloo")
    llm = LLM(kv_cache_bytes=256 << 20, max_num_seqs=64, tensor_parallel_size=2)
    runs = measure(llm, args.concurrency, args.repeats, args.max_tokens)
    reduce_us = {c: all_reduce_us(c) for c in args.concurrency}
    dist.destroy_process_group()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"runs": runs, "all_reduce_us": reduce_us}))


def run_ranks(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "ops.bench.bench_tp", "--init-file", f"{tmp}/rendezvous",
               "--out", str(out), "--repeats", str(args.repeats), "--max-tokens",
               str(args.max_tokens), "--concurrency", *map(str, args.concurrency)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env)
                 for r in range(2)]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"a rank exited {p.returncode}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    llm = LLM(kv_cache_bytes=256 << 20, max_num_seqs=64)
    results: dict[str, Any] = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        results[f"tp1_{threads}threads"] = measure(llm, args.concurrency, args.repeats,
                                                   args.max_tokens)
    del llm
    tp2 = run_ranks(args)
    results["tp2_1thread_each"] = {int(c): v for c, v in tp2["runs"].items()}
    results["all_reduce_us"] = tp2["all_reduce_us"]
    for c in args.concurrency:
        med = {k: statistics.median(results[k][c]) for k in
               ("tp1_2threads", "tp1_1threads", "tp2_1thread_each")}
        best = max(med["tp1_2threads"], med["tp1_1threads"])
        print(f"concurrency {c:3d}: decode tok/s TP=1 2 threads {med['tp1_2threads']:.1f}, "
              f"TP=1 1 thread {med['tp1_1threads']:.1f}, TP=2 {med['tp2_1thread_each']:.1f} "
              f"({med['tp2_1thread_each'] / best:.2f}x of the faster TP=1); "
              f"all-reduce {results['all_reduce_us'][str(c)]:.0f} us", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
