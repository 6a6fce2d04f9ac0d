"""The headline experiment: same KV byte budget, BF16 vs FP8 pages, concurrency sweep.

    python3 -m ops.bench.bench_kv_formats --kv-cache-bytes 67108864 --concurrency 1 8 16 32 64

Both engines get the same budget (scales included), the same real-text prompts and the same
output lengths (ignore_eos), no prefix reuse. At each level the two formats run back to back,
so machine noise hits both; with `--repeats N` each level runs N times (formats alternating)
and every figure is the median of the N. BF16 pages hold about half the tokens, so it runs out
of pages (and queues or preempts) at a lower concurrency; reported per point: output tok/s, the
most sequences that ran at once, preemptions, and the ratio of FP8's best to BF16's best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ops.bench.workload import BenchRequest, make_workload
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.sampling_params import SamplingParams

FORMATS = ("bf16", "fp8")


def run_level(engine: LLMEngine, reqs: list[BenchRequest], concurrency: int) -> dict:
    cfg = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(cfg, max_num_seqs=concurrency)
    preempted_before = engine.scheduler.num_preemptions
    for i, r in enumerate(reqs):
        engine.add_request(f"k{i}", r.prompt, SamplingParams(
            max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    tokens, peak_running = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        tokens += sum(len(o.delta_token_ids) for o in outs)
        peak_running = max(peak_running, len(engine.scheduler.running))
    wall = time.perf_counter() - start
    engine.check_quiescent()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "peak_running": peak_running,
            "preemptions": engine.scheduler.num_preemptions - preempted_before}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--requests-per-slot", type=float, default=1.5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-prompt-chars", type=int, default=200)
    ap.add_argument("--max-prompt-chars", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=1, help="runs per level; medians reported")
    ap.add_argument("--out", default="ops/bench/out/kv_formats.json")
    args = ap.parse_args(argv)
    engines = {f: LLMEngine.from_path(None, EngineConfig(
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_dtype=f, max_num_seqs=max(args.concurrency),
        enable_prefix_caching=False)) for f in FORMATS}
    warm = make_workload(2, args.output_len, args.output_len, seed=99)
    for engine in engines.values():  # first fp8 step compiles the page decode
        run_level(engine, warm, 2)
    rows = []
    for c in args.concurrency:
        reqs = make_workload(max(2, int(args.requests_per_slot * c)), args.output_len,
                             args.output_len, args.min_prompt_chars, args.max_prompt_chars,
                             seed=c)
        row: dict = {"concurrency": c, "requests": len(reqs)}
        runs: dict[str, list[dict]] = {f: [] for f in engines}
        for _ in range(args.repeats):
            for f, engine in engines.items():
                runs[f].append(run_level(engine, reqs, c))
        for f, results in runs.items():
            row[f] = {key: statistics.median(r[key] for r in results) for key in results[0]}
            row[f]["runs_tok_s"] = [r["tok_s"] for r in results]
        rows.append(row)
        print(json.dumps(row), flush=True)
    capacity = {f: e.kv_capacity_tokens for f, e in engines.items()}
    best = {f: max(r[f]["tok_s"] for r in rows) for f in FORMATS}
    report = {"date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "kv_cache_bytes": args.kv_cache_bytes,
              "repeats": args.repeats,
              "capacity_tokens": capacity, "rows": rows, "best_tok_s": best,
              "best_ratio_fp8_over_bf16": best["fp8"] / best["bf16"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    cap = report["capacity_tokens"]
    lines = [f"KV budget {report['kv_cache_bytes'] / 2**20:.0f} MiB: BF16 {cap['bf16']} tokens, "
             f"FP8 {cap['fp8']} tokens ({cap['fp8'] / cap['bf16']:.2f}x).", "",
             "| concurrency | requests | BF16 tok/s | BF16 peak running / preemptions | "
             "FP8 tok/s | FP8 peak running / preemptions | FP8 / BF16 |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        b, f = r["bf16"], r["fp8"]
        lines.append(f"| {r['concurrency']} | {r['requests']} | {b['tok_s']:.1f} | "
                     f"{b['peak_running']} / {b['preemptions']} | {f['tok_s']:.1f} | "
                     f"{f['peak_running']} / {f['preemptions']} | "
                     f"{f['tok_s'] / b['tok_s']:.2f}x |")
    best = report["best_tok_s"]
    lines.append(f"\nBest: BF16 {best['bf16']:.1f} tok/s, FP8 {best['fp8']:.1f} tok/s: "
                 f"FP8/BF16 = {report['best_ratio_fp8_over_bf16']:.2f}x.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
