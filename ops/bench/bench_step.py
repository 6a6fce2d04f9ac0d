"""Milliseconds per decode step at several concurrencies, this tree against a git ref, one run.

    python3 -m ops.bench.bench_step --concurrency 1 8 32 --steps 20 --ref main
    python3 -m ops.bench.bench_step --concurrency 1 32 --profile   # top ops of one step
    python3 -m ops.bench.bench_step --config gguf_activations=float32   # an EngineConfig field

Each concurrency admits that many requests with ~100-token prompts (real text), runs their
prefills, then times `--steps` engine steps in which every request decodes one token (the
whole step: integrity check, model, sampler, bookkeeping). With `--ref`, the same measurement
runs in a checkout of that ref (a temporary git worktree), the two trees alternating round by
round so background load falls on both alike; the table gives the ratio per concurrency.
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

REPO = Path(__file__).resolve().parents[2]
PROMPT = ("The history of computing is a story of machines that grew smaller, faster and "
          "cheaper, while the problems people asked them to solve grew larger. ")


def _engine(threads: int | None, kv_cache_bytes: int, max_seqs: int,
            extra: dict[str, str] | None = None) -> Any:
    import torch

    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine

    if threads is not None:
        torch.set_num_threads(threads)
    config = EngineConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_seqs,
                          enable_prefix_caching=False, **(extra or {}))
    return LLMEngine.from_path(None, config)


def decode_step_ms(engine: Any, concurrency: int, steps: int, warmup: int = 3,
                   profile: bool = False) -> dict[str, list[float]]:
    """Milliseconds of each of `steps` all-decode steps with `concurrency` sequences: `wall`
    and `cpu` (this process's CPU time, all its threads: on a shared, loaded machine the
    steadier of the two, exact at one thread)."""
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + warmup + 8, temperature=0.0, ignore_eos=True)
    ids = [f"s{concurrency}-{i}" for i in range(concurrency)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, f"{i}. " + PROMPT * 4, params)
    while any(len(engine.requests[r].output_token_ids) == 0 for r in ids):
        engine.step()  # prefills (chunked), until every sequence has sampled once
    for _ in range(warmup):
        engine.step()
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        times["cpu"].append(1e3 * (time.process_time() - start_cpu))
        times["wall"].append(1e3 * (time.perf_counter() - start))
    if profile:
        _profile_one_step(engine, concurrency)
    for rid in ids:
        engine.abort_request(rid)
    return times


def _profile_one_step(engine: Any, concurrency: int, top: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    print(f"\n## top ops, 3 decode steps at concurrency {concurrency} (self CPU time)\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    extra = dict(kv.split("=", 1) for kv in args.config)
    engine = _engine(args.threads, args.kv_cache_bytes, max(args.concurrency), extra)
    engine.warm_up()
    return {str(c): decode_step_ms(engine, c, args.steps, profile=args.profile)
            for c in args.concurrency}


def _worker_command(args: argparse.Namespace, tree: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--steps", str(args.steps),
           "--kv-cache-bytes", str(args.kv_cache_bytes), "--tree", str(tree),
           "--concurrency", *map(str, args.concurrency)]
    cmd += [f"--config={kv}" for kv in args.config]
    return cmd + (["--threads", str(args.threads)] if args.threads else [])


def _run_tree(args: argparse.Namespace, tree: Path) -> dict[str, dict[str, list[float]]]:
    out = subprocess.run(_worker_command(args, tree), capture_output=True, text=True,
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=False)
    if out.returncode != 0:
        raise SystemExit(f"measurement in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        ref_tree = Path(tmp) / "ref"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(ref_tree),
                        args.ref], check=True, capture_output=True)
        try:
            runs: dict[str, dict[str, dict[str, list[float]]]] = {"this": {}, args.ref: {}}
            for _ in range(args.rounds):
                for name, tree in ((args.ref, ref_tree), ("this", REPO)):
                    for c, times in _run_tree(args, tree).items():
                        for kind, ms in times.items():
                            runs[name].setdefault(c, {}).setdefault(kind, []).extend(ms)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(ref_tree)], check=False, capture_output=True)
    print(f"| concurrency | clock | {args.ref} ms/step (median) | this tree | "
          f"ratio {args.ref}/this |")
    print("|---|---|---|---|---|")
    for c in map(str, args.concurrency):
        for kind in ("cpu", "wall"):
            ref_ms = statistics.median(runs[args.ref][c][kind])
            this_ms = statistics.median(runs["this"][c][kind])
            print(f"| {c} | {kind} | {ref_ms:.1f} | {this_ms:.1f} | {ref_ms / this_ms:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per concurrency")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--ref", default=None, help="git ref to compare against, in the same run")
    p.add_argument("--rounds", type=int, default=2, help="with --ref: alternations of trees")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops")
    p.add_argument("--json", action="store_true", help="print the raw step times as JSON")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig string field, e.g. gguf_activations=float32 "
                        "(repeatable; passed to --ref's tree too)")
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ref is not None:
        compare(args)
        return
    times = measure(args)
    if args.json:
        print(json.dumps(times))
        return
    print("| concurrency | wall ms/step median | p90 | tok/s | CPU ms/step median |")
    print("|---|---|---|---|---|")
    for c, t in times.items():
        med = statistics.median(t["wall"])
        p90 = statistics.quantiles(t["wall"], n=10)[-1] if len(t["wall"]) > 1 else med
        print(f"| {c} | {med:.1f} | {p90:.1f} | {int(c) * 1e3 / med:.0f} | "
              f"{statistics.median(t['cpu']):.1f} |")


if __name__ == "__main__":
    main()
