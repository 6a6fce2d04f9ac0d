"""Scale from zero: the cold penalty of a pool at zero workers, `tessera serve` start to first
token, and each worker's memory, with workers forked from a template and spawned afresh;
llama-server's start in the same run when given; the start broken down by phase.

    PYTHONPATH=$PWD python3 -m ops.bench.bench_scale_from_zero --trials 20 \
        [--llama-server PATH --gguf PATH] [--json out.json]

- cold penalty: time to first token of a request (16 prompt tokens, 1 output token) sent to a
  pool that has scaled to zero (`--min-workers 0`, idle TTL 0.3 s), minus the same request's
  time on the worker it woke; p50 and p99 over `--trials`.
- serve start to first token: `tessera serve` as a fresh process (min 1 worker) until the first
  token of one such request arrives; median over `--serve-trials`, with the CPU seconds its
  process tree had spent by then (ops/bench/start_measures.py), and by phase: exec -> template
  launched -> gateway up (gRPC server and pools started) -> template ready -> first worker
  ready -> first token, with the gateway process's own CPU at each mark and the template's at
  its ready. llama-server the same way, when `--llama-server` and `--gguf` are given.
- memory: PSS and private bytes (/proc/PID/smaps_rollup) of one worker alone, then of each of
  two, and private resident bytes, KV pages included (the pool is a lazily committed mapping,
  resident where touched).
- phases: the template's load (once), and each worker's start by phase as its readiness
  reported it (gateway/readiness.py: start_phases): fork, map, tokenizer, KV pool, warm-up.
`--phases-only` measures just the template's cold penalty and its workers' phases;
`--serve-root main=/work/main --serve-root new=.` just serve's start, from each checkout in turn
(an A/B whose trials interleave, so that a busy machine slows both alike).
Numbers from a shared machine are only as quiet as the machine: say its load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from gateway.auth import ApiKeys
from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig
from ops.bench.scale_report import report
from ops.bench.start_measures import kv_pool_cost, llama_server_start, serve_start

KEY, MODEL = "bench-key", "bench"
PROMPT = list(range(1000, 1016))  # 16 prompt tokens
KV_BYTES = 32 << 20


def _ttft(target: str) -> float:
    with Client(target, api_key=KEY) as client:
        started = time.monotonic()
        stream = client.generate(PROMPT, max_tokens=1, temperature=0.0, ignore_eos=True)
        chunks = iter(stream)  # NOTE: one iterator: a second iter(stream) sends the request again
        next(chunks)
        first = time.monotonic() - started
        list(chunks)
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
            ready = [(w.cold_start_s, w.start_phases, w.start_cpu_s) for w in pool.ready()]
            warm = _ttft(runner.target)
            rows.append({"cold_s": cold, "warm_s": warm, "penalty_s": cold - warm,
                         "worker_ready_s": ready[0][0] if ready else float("nan"),
                         "phases_s": ready[0][1] if ready else {},
                         "worker_cpu_s": ready[0][2] if ready else float("nan")})
        t = pool._template
        phases = {} if t is None else dict(t.phases)
        cpu_phases = {} if t is None else dict(t.cpu_phases)
    finally:
        runner.stop()
    pen = [r["penalty_s"] for r in rows]
    return {"template": template, "trials": len(rows), "p50_s": _percentile(pen, 0.5),
            "p99_s": _percentile(pen, 0.99), "warm_p50_s": statistics.median(
                r["warm_s"] for r in rows),
            "worker_ready_p50_s": statistics.median(r["worker_ready_s"] for r in rows),
            "worker_phases_p50_s": _phase_medians([r["phases_s"] for r in rows]),
            "worker_cpu_p50_s": statistics.median(r["worker_cpu_s"] for r in rows),
            "template_phases_s": phases, "template_cpu_phases_s": cpu_phases, "rows": rows}


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
        out.append(_memory_row("1 alone", pool.ready()[0].pid))
        runner.call(_grow(pool), timeout_s=600)
        _wait(lambda: len(pool.ready()) == 2, 600)
        _ttft(runner.target)
        for i, w in enumerate(sorted(pool.ready(), key=lambda w: w.started_at)):
            out.append(_memory_row(f"{i + 1} of 2", w.pid))
        if pool._template is not None and pool._template.pid is not None:
            out.append(_memory_row("the template", pool._template.pid))
    finally:
        runner.stop()
    return out


def _memory_row(worker: str, pid: int) -> dict[str, object]:
    m = _smaps(pid)
    private = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
    return {"worker": worker, "pss_mib": m.get("Pss", 0) / 2**20,
            "private_mib": private / 2**20, "rss_mib": m.get("Rss", 0) / 2**20}


async def _grow(pool) -> None:  # type: ignore[no-untyped-def]
    pool._spawn()  # NOTE: a second worker on demand, as a burst would start it


def serve_ab(roots: list[str], trials: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """`tessera serve` start to first token from each `LABEL=CHECKOUT` in `roots`, with the
    template and spawned, `trials` rounds of every (checkout, variant) in turn, so that a busy
    machine slows them alike: {label: {"template": [...], "spawn": [...]}}."""
    checkouts = dict(root.split("=", 1) for root in roots)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {
        label: {"template": [], "spawn": []} for label in checkouts}
    for _ in range(trials):
        for template in (True, False):
            for label, root in checkouts.items():
                out[label]["template" if template else "spawn"].append(
                    serve_start(template, _ttft, KEY, MODEL, KV_BYTES,
                                root=os.path.abspath(root)))
    return out


def _llama_server(args: argparse.Namespace) -> list[dict[str, float]] | str:
    if not (args.llama_server and args.gguf):
        return "no --llama-server PATH --gguf PATH given"
    try:
        return [llama_server_start(args.llama_server, args.gguf, " ".join(["Hello"] * 16))
                for _ in range(args.serve_trials)]
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--serve-trials", type=int, default=3)
    p.add_argument("--llama-server", default=None, help="a llama-server binary, started as "
                   "tessera serve is (2 threads) and timed to its first token")
    p.add_argument("--gguf", default=None, help="the GGUF llama-server loads (the default "
                   "model's: python -c 'from runtime.loader import default_model_path as d; "
                   "print(d())')")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--phases-only", action="store_true",
                   help="only the template's cold penalty and its workers' start phases")
    p.add_argument("--serve-root", action="append", default=[], metavar="LABEL=CHECKOUT",
                   help="only `tessera serve` start to first token, by phase, with and without "
                        "the template, run from each checkout given (repeat it: A/B, the "
                        "trials interleaved)")
    args = p.parse_args(argv)
    results: dict[str, object] = {"loadavg_1m": os.getloadavg()[0], "cores": os.cpu_count(),
                                  "kv_bytes": KV_BYTES}
    if args.phases_only:
        results["cold_template"] = cold_penalty(True, args.trials)
    elif args.serve_root:
        results["serve_ab"] = serve_ab(args.serve_root, args.serve_trials)
    else:
        for template in (True, False):
            name = "template" if template else "spawn"
            results[f"cold_{name}"] = cold_penalty(template, args.trials)
            results[f"serve_{name}"] = [serve_start(template, _ttft, KEY, MODEL, KV_BYTES)
                                        for _ in range(args.serve_trials)]
            results[f"memory_{name}"] = memory(template)
        results["llama_server"] = _llama_server(args)
        results["kv_pool"] = kv_pool_cost(KV_BYTES)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
