"""Scale from zero: the cold penalty of a pool at zero workers, `tessera serve` start to first
token, and each worker's memory, with workers forked from a template and spawned afresh.

    PYTHONPATH=$PWD python3 -m ops.bench.bench_scale_from_zero --trials 20

- cold penalty: time to first token of a request (16 prompt tokens, 1 output token) sent to a
  pool that has scaled to zero (`--min-workers 0`, idle TTL 0.3 s), minus the same request's
  time on the worker it woke; p50 and p99 over `--trials`.
- serve start to first token: `tessera serve` as a fresh process (min 1 worker) until the first
  token of one such request arrives; median over `--serve-trials`.
- memory: PSS and private bytes (/proc/PID/smaps_rollup) of each of 2 workers, and private
  resident bytes, KV pages included (the pool is allocated whole, resident where touched).
Phases: the template's load phases, and each worker's start by phase as its readiness
reported it (gateway/readiness.py: start_phases); `--phases-only` measures just those and the
template's cold penalty, for a quick look.
Numbers from a shared machine are only as quiet as the machine: say its load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from gateway.auth import ApiKeys
from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig

KEY, MODEL = "bench-key", "bench"
PROMPT = list(range(1000, 1016))  # 16 prompt tokens
KV_BYTES = 32 << 20


def _ttft(target: str) -> float:
    with Client(target, api_key=KEY) as client:
        started = time.monotonic()
        stream = client.generate(PROMPT, max_tokens=1, temperature=0.0, ignore_eos=True)
        next(iter(stream))
        first = time.monotonic() - started
        list(stream)
    return first


def _pool(template: bool, **kw: object) -> PoolConfig:
    base: dict[str, object] = dict(kv_cache_bytes=KV_BYTES, worker_threads=1,
                                   template=template)
    base.update(kw)
    return PoolConfig(MODEL, **base)  # type: ignore[arg-type]


def _wait(predicate, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not reach the state asked for")
        time.sleep(0.02)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def cold_penalty(template: bool, trials: int) -> dict[str, object]:
    runner = GatewayRunner([_pool(template, min_workers=0, max_workers=1, idle_ttl_s=0.3)],
                           ApiKeys.parse(f"{KEY}=bench")).start(wait_ready=False)
    pool = runner.gateway.pools[MODEL]
    rows: list[dict[str, float]] = []
    try:
        if pool._template is not None:
            runner.call(pool._template.ready.wait(), timeout_s=600)
        _ttft(runner.target)  # the first worker ever: the mapped file, page cache
        for _ in range(trials):
            _wait(lambda: not pool.live())
            cold = _ttft(runner.target)
            ready = [(w.cold_start_s, w.start_phases) for w in pool.ready()]
            warm = _ttft(runner.target)
            rows.append({"cold_s": cold, "warm_s": warm, "penalty_s": cold - warm,
                         "worker_ready_s": ready[0][0] if ready else float("nan"),
                         "phases_s": ready[0][1] if ready else {}})
        phases = dict(pool._template.phases) if pool._template is not None else {}
    finally:
        runner.stop()
    pen = [r["penalty_s"] for r in rows]
    return {"template": template, "trials": len(rows), "p50_s": _percentile(pen, 0.5),
            "p99_s": _percentile(pen, 0.99), "warm_p50_s": statistics.median(
                r["warm_s"] for r in rows),
            "worker_ready_p50_s": statistics.median(r["worker_ready_s"] for r in rows),
            "worker_phases_p50_s": _phase_medians([r["phases_s"] for r in rows]),
            "template_phases_s": phases, "rows": rows}


def _phase_medians(trials: list[dict[str, float]]) -> dict[str, float]:
    """Per phase of a worker's start (gateway/readiness.py: start_phases), its median."""
    names = list(dict.fromkeys(name for t in trials for name in t))
    return {n: round(statistics.median(t.get(n, 0.0) for t in trials), 4) for n in names}


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def memory(template: bool) -> list[dict[str, float]]:
    """PSS and private MiB of worker 1 alone, then of both once a second one started."""
    runner = GatewayRunner([_pool(template, min_workers=1, max_workers=2)],
                           ApiKeys.parse(f"{KEY}=bench")).start()
    pool = runner.gateway.pools[MODEL]
    out = []
    try:
        _ttft(runner.target)
        runner.call(_grow(pool), timeout_s=600)
        _wait(lambda: len(pool.ready()) == 2, 600)
        _ttft(runner.target)
        for i, w in enumerate(sorted(pool.ready(), key=lambda w: w.started_at)):
            m = _smaps(w.pid)
            private = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
            out.append({"worker": i + 1, "pss_mib": m.get("Pss", 0) / 2**20,
                        "private_mib": private / 2**20, "rss_mib": m.get("Rss", 0) / 2**20})
    finally:
        runner.stop()
    return out


async def _grow(pool) -> None:  # type: ignore[no-untyped-def]
    pool._spawn()  # NOTE: a second worker on demand, as a burst would start it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_start(template: bool) -> float:
    """Seconds from `tessera serve` exec to the first token of one request."""
    port = _free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        f.write(f"{KEY}=bench\n")
    cmd = [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(port),
           "--api-keys", f.name, "--model-id", MODEL, "--min-workers", "1",
           "--max-workers", "2" if template else "1", "--worker-threads", "1",
           "--kv-cache-bytes", str(KV_BYTES), "--no-http"]
    if not template:
        cmd.append("--no-worker-template")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tessera serve exited with {proc.returncode}")
            try:
                _ttft(f"127.0.0.1:{port}")
                return time.monotonic() - started
            except Exception:  # not up yet: UNAVAILABLE, or no worker yet
                if time.monotonic() - started > 600:
                    raise
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
        os.unlink(f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--serve-trials", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--phases-only", action="store_true",
                   help="only the template's cold penalty and its workers' start phases")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    results: dict[str, object] = {"loadavg_1m": load, "cores": os.cpu_count()}
    if args.phases_only:
        cold = cold_penalty(True, args.trials)
        print(f"load average {load:.1f} on {os.cpu_count()} cores; {cold['trials']} trials")
        print(f"cold penalty p50 {cold['p50_s'] * 1e3:.0f} ms, p99 {cold['p99_s'] * 1e3:.0f} "
              f"ms; warm TTFT p50 {cold['warm_p50_s'] * 1e3:.0f} ms")
        print("forked worker's start, median per phase (ms):",
              json.dumps({k: round(v * 1e3, 1)
                          for k, v in cold["worker_phases_p50_s"].items()}))  # type: ignore[union-attr]
        return 0
    for template in (True, False):
        name = "template" if template else "spawn"
        results[f"cold_{name}"] = cold_penalty(template, args.trials)
        results[f"serve_{name}_s"] = [serve_start(template) for _ in range(args.serve_trials)]
        results[f"memory_{name}"] = memory(template)
    print(f"load average {load:.1f} on {os.cpu_count()} cores\n")
    print("| workers from | cold penalty p50 (ms) | p99 (ms) | trials | warm TTFT p50 (ms) | "
          "worker ready p50 (s) | serve start to first token (s, median) |\n"
          "|---|---|---|---|---|---|---|")
    for name in ("template", "spawn"):
        c = results[f"cold_{name}"]
        assert isinstance(c, dict)
        serve = statistics.median(results[f"serve_{name}_s"])  # type: ignore[arg-type]
        print(f"| {name} | {c['p50_s'] * 1e3:.0f} | {c['p99_s'] * 1e3:.0f} | {c['trials']} | "
              f"{c['warm_p50_s'] * 1e3:.0f} | {c['worker_ready_p50_s']:.2f} | {serve:.2f} |")
    print(f"\n| workers from | worker | PSS (MiB) | private (MiB, touched KV included; pool "
          f"{KV_BYTES >> 20} MiB) | RSS (MiB) |\n|---|---|---|---|---|")
    for name in ("template", "spawn"):
        for m in results[f"memory_{name}"]:  # type: ignore[union-attr]
            print(f"| {name} | {m['worker']} | {m['pss_mib']:.0f} | {m['private_mib']:.0f} | "
                  f"{m['rss_mib']:.0f} |")
    phases = results["cold_template"]["template_phases_s"]  # type: ignore[index]
    print("\ntemplate load phases (s, once per template):", json.dumps(phases))
    for name in ("template", "spawn"):
        worker = results[f"cold_{name}"]["worker_phases_p50_s"]  # type: ignore[index]
        print(f"worker start phases, {name} (s, median):", json.dumps(worker))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
