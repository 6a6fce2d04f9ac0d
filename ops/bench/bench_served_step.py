"""Where a served step's time goes (issue 32): a real `tessera serve`, the OpenAI REST route, a
closed-loop workload per concurrency, and an account of every output token's wall time.

    python3 -m ops.bench.bench_served_step --concurrency 1 8 32 --input-len 128 --output-len 64
    python3 -m ops.bench.bench_served_step --tree main=/work/main --tree this=.   # A/B, one run

Each tree's server starts (`python -m ops.cli serve`, PYTHONPATH the tree) and all stay up; at
every level the trees take turns (the order alternating), each sent the same prompts by this
process through `tessera bench serve`'s OpenAI backend. Per level and tree it reports:

- the served wall per output token (the level's first send to last reply over its tokens), split
  by the engine's own counters (runtime/step_times.py, read from the gateway's `/metrics`) into
  all-decode steps (compute: the model and sampler; host: the rest of the step), mixed steps
  (a prefill chunk in them), the engine loop's commands and publishing, and the rest: the
  loop waiting for work (the requests are somewhere between the engine and the client);
- the mean decode and mixed step, their rows, and with `--reference` the engine-level
  all-decode step (ops/bench/bench_step.py, in this process, after the servers stop) at the
  served decode steps' mean batch;
- CPU seconds per output token of the gateway process (gateway, REST shim), the worker
  processes (split into the engine thread, the servicer's event loop thread and the rest:
  compute pool threads, gRPC's), and this client, from /proc (psutil).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from ops.bench.serving.backends import OpenAIBackend
from ops.bench.serving.load import Level, run_level
from ops.bench.serving.metrics import summarize
from ops.bench.soak import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "bench-served-step"
STATUS_POLL_S = 2.5  # the supervisor reads each worker's Status every 2 s (gateway/supervisor.py)
_METRIC = re.compile(r'^(tessera_worker_engine_\w+)\{([^}]*)\} (\S+)$')


@dataclass
class Server:
    label: str
    tree: Path
    flags: list[str] = field(default_factory=list)  # more `tessera serve` flags
    env: dict[str, str] = field(default_factory=dict)  # more environment for it
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log: Any = None  # the server's stdout and stderr, open while it runs

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"


def start(server: Server, keys: Path, log_dir: Path, timeout_s: float = 300.0) -> None:
    """Spawn the tree's `tessera serve` and wait until a one-token completion succeeds."""
    env = {**os.environ, "PYTHONPATH": str(server.tree), **server.env}
    log = server.log = open(log_dir / f"{server.label}.log", "wb")
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", "0", "--http-port",
         str(server.http_port), "--metrics-port", str(server.metrics_port), "--api-keys",
         str(keys), *server.flags], cwd=server.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.label}: serve exited; see {log.name}")
            try:
                model = http.get("/models").json()["data"][0]["id"]
                if http.post("/completions", json={"model": model, "prompt": "Hi",
                                                   "max_tokens": 1}).status_code == 200:
                    return
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{server.label} not ready after {timeout_s} s")


def stop(server: Server) -> None:
    if server.proc is not None and server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    if server.log is not None:
        server.log.close()


def engine_counters(server: Server) -> dict[str, float]:
    """The workers' engine counters on the gateway's /metrics, summed over workers:
    `steps.decode`, `step_seconds.mixed.compute`, `loop_seconds.idle`, ..."""
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        parts = [labels[k] for k in ("kind", "part", "tokens") if k in labels]
        key = ".".join([m.group(1).removeprefix("tessera_worker_engine_"), *parts])
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _thread_cpu(proc: psutil.Process) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except psutil.Error:
        return {}


def process_cpu(server: Server) -> dict[str, float]:
    """CPU seconds so far: the gateway process (gateway and REST shim), its descendants (the
    worker processes and a template), and of those the main threads (the servicers' event
    loops)."""
    assert server.proc is not None
    gateway = psutil.Process(server.proc.pid)
    out = {"gateway": sum(_thread_cpu(gateway).values()), "workers": 0.0,
           "workers_main_thread": 0.0}
    for child in gateway.children(recursive=True):
        threads = _thread_cpu(child)
        out["workers"] += sum(threads.values())
        out["workers_main_thread"] += threads.get(child.pid, 0.0)
    return out


def snapshot(server: Server) -> dict[str, float]:
    return {**engine_counters(server), **{f"cpu.{k}": v for k, v in process_cpu(server).items()}}


def account(before: dict[str, float], after: dict[str, float], wall_s: float,
            tokens: int) -> dict[str, Any]:
    """One level's breakdown: ms per output token of wall (engine parts and the rest) and of
    CPU (per process), and the mean steps."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    per = 1e3 / max(1, tokens)
    wall = {"decode_compute": d.get("step_seconds.decode.compute", 0.0),
            "decode_host": d.get("step_seconds.decode.host", 0.0),
            "mixed_compute": d.get("step_seconds.mixed.compute", 0.0),
            "mixed_host": d.get("step_seconds.mixed.host", 0.0),
            "loop_commands": d.get("loop_seconds.commands", 0.0),
            "loop_publish": d.get("loop_seconds.publish", 0.0)}
    # NOTE: the rest is the loop waiting for work (or between passes): nothing steps outside
    # a level, while the idle counter also runs between levels (the gauges lag 2 s).
    wall["engine_waiting"] = max(0.0, wall_s - sum(wall.values()))
    if not any(k.startswith("steps.") for k in after):  # a tree whose workers count nothing
        wall = {k: None for k in wall}
    engine_thread = d.get("loop_seconds.cpu")
    workers = d.get("cpu.workers", 0.0)
    main_thread = d.get("cpu.workers_main_thread", 0.0)
    cpu = {"gateway": d.get("cpu.gateway", 0.0), "worker_engine_thread": engine_thread,
           "worker_servicer_thread": main_thread,
           "worker_other_threads": workers - (engine_thread or 0.0) - main_thread,
           "client": d.get("cpu.client", 0.0)}
    steps = {}
    for kind in ("decode", "mixed"):
        n = d.get(f"steps.{kind}", 0.0)
        secs = d.get(f"step_seconds.{kind}.compute", 0.0) + d.get(f"step_seconds.{kind}.host",
                                                                   0.0)
        steps[kind] = {"steps": int(n), "mean_ms": 1e3 * secs / n if n else None,
                       "mean_decode_rows": d.get(f"step_tokens.{kind}.decode", 0.0) / n
                       if n else None,
                       "mean_prefill_tokens": d.get(f"step_tokens.{kind}.prefill", 0.0) / n
                       if n else None}
    return {"wall_s": wall_s, "output_tokens": tokens,
            "wall_ms_per_token": {k: None if v is None else v * per for k, v in wall.items()},
            "cpu_ms_per_token": {k: None if v is None else v * per for k, v in cpu.items()},
            "cpu_utilisation": sum(v or 0.0 for v in cpu.values()) / wall_s
            / (os.cpu_count() or 1),
            "steps": steps}


async def run_level_on(server: Server, prompts: list, level: Level) -> dict[str, Any]:
    backend = OpenAIBackend(server.label, server.base_url, KEY, None, 512)
    await backend.open()
    try:
        before = snapshot(server)
        before["cpu.client"] = time.process_time()
        run = await run_level(backend, prompts, level, ignore_eos=True, max_duration_s=600,
                              request_timeout_s=600)
        after = {f"cpu.{k}": v for k, v in process_cpu(server).items()}
        after["cpu.client"] = time.process_time()
    finally:
        await backend.close()
    await asyncio.sleep(STATUS_POLL_S)  # then the gauges hold the level's last step
    after.update(engine_counters(server))
    m = summarize(run.results, run.duration_s)
    out = account(before, after, run.duration_s, m["total_output_tokens"])
    out.update(failed=m["failed"], output_tok_s=m["output_throughput"],
               ttft_p50_ms=m["ttft_ms"]["median"], tpot_p50_ms=m["tpot_ms"]["median"])
    return out


async def measure(servers: list[Server], args: argparse.Namespace) -> dict[str, Any]:
    from ops.bench.serving.cli import prompt_maker

    maker = prompt_maker(None)
    warm = maker.random_prompts(2, args.input_len, args.output_len, seed=args.seed - 1)
    for s in servers:  # first-use costs of this client and the servers, not measured
        await run_level_on(s, warm, Level(concurrency=1))
    results: dict[str, Any] = {s.label: {} for s in servers}
    for i, c in enumerate(args.concurrency):
        prompts = maker.random_prompts(args.requests_per_level * c, args.input_len,
                                       args.output_len, seed=args.seed + 1000 * (i + 1))
        for s in servers if i % 2 == 0 else servers[::-1]:
            load = os.getloadavg()[0]
            r = await run_level_on(s, prompts, Level(concurrency=c))
            r["load_average_before"] = load
            results[s.label][str(c)] = r
            print(f"{s.label} c={c}: {r['output_tok_s']:.1f} tok/s, TPOT p50 "
                  f"{r['tpot_p50_ms'] or 0:.0f} ms, load {load:.1f}", flush=True)
    return results


def reference_steps(results: dict[str, Any], steps: int) -> dict[str, float]:
    """The engine-level all-decode step (bench_step) at each level's mean served decode
    batch (rounded), in a process of its own (this one's client threads would share libgomp
    with it: runtime/threads.py): batch -> median wall ms."""
    batches = sorted({max(1, round(lv["steps"]["decode"]["mean_decode_rows"]))
                      for tree in results.values() for lv in tree.values()
                      if lv["steps"]["decode"]["mean_decode_rows"]})
    if not batches:
        return {}
    cmd = [sys.executable, "-m", "ops.bench.bench_step", "--json", "--steps", str(steps),
           "--concurrency", *map(str, batches)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the engine-level reference failed:\n{done.stderr[-3000:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {b: statistics.median(t["wall"]) for b, t in times.items()}


def table(results: dict[str, Any], reference: dict[str, float]) -> str:
    parts = ["decode_compute", "decode_host", "mixed_compute", "mixed_host", "loop_commands",
             "loop_publish", "engine_waiting"]
    cpus = ["gateway", "worker_engine_thread", "worker_servicer_thread", "worker_other_threads",
            "client"]
    lines = ["| tree | c | tok/s | TPOT p50 | wall ms/token | " + " | ".join(parts)
             + " | decode step ms (rows) | mixed step ms (prefill tok + rows) | engine-level "
             "decode step ms | CPU ms/token: " + " / ".join(cpus) + " |",
             "|" + "---|" * (11 + len(parts))]
    for label, levels in results.items():
        for c, r in levels.items():
            w, st = r["wall_ms_per_token"], r["steps"]
            dec, mix = st["decode"], st["mixed"]
            ref = reference.get(str(round(dec["mean_decode_rows"] or 0)))

            def f(x: float | None, spec: str = ".1f") -> str:
                return "-" if x is None else format(x, spec)

            lines.append(
                f"| {label} | {c} | {r['output_tok_s']:.1f} | {f(r['tpot_p50_ms'], '.0f')} | "
                f"{1e3 * r['wall_s'] / max(1, r['output_tokens']):.2f} | "
                + " | ".join(f(w[p], ".2f") for p in parts)
                + f" | {f(dec['mean_ms'])} ({f(dec['mean_decode_rows'])}) | {f(mix['mean_ms'])}"
                f" ({f(mix['mean_prefill_tokens'], '.0f')} + {f(mix['mean_decode_rows'])}) | "
                f"{f(ref)} | " + " / ".join(f(r["cpu_ms_per_token"][k], ".2f") for k in cpus)
                + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=None, metavar="LABEL=PATH",
                   help="a checkout whose `tessera serve` to measure (repeat: A/B in one run; "
                        "default this tree)")
    p.add_argument("--serve-flags", action="append", default=[], metavar="LABEL=FLAGS",
                   help="more `tessera serve` flags for one tree, e.g. "
                        "'one=--worker-threads 1' (the same checkout may be two trees)")
    p.add_argument("--serve-env", action="append", default=[], metavar="LABEL=KEY=VALUE",
                   help="an environment variable for one tree's server, e.g. "
                        "'passive=OMP_WAIT_POLICY=PASSIVE'")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=4, help="x concurrency")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--reference", action="store_true",
                   help="also time the engine-level all-decode step at the served batch")
    p.add_argument("--reference-steps", type=int, default=20)
    p.add_argument("--out", default="ops/bench/out/served_step.json")
    args = p.parse_args(argv)
    specs = args.tree or [f"this={REPO}"]
    servers = [Server(label, Path(path).resolve())
               for label, _, path in (spec.partition("=") for spec in specs)]
    by_label = {sv.label: sv for sv in servers}
    for spec in args.serve_flags:
        label, _, flags = spec.partition("=")
        by_label[label].flags += shlex.split(flags)
    for spec in args.serve_env:
        label, _, kv = spec.partition("=")
        key, _, value = kv.partition("=")
        by_label[label].env[key] = value
    with tempfile.TemporaryDirectory(prefix="served-step-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"{KEY}=bench\n")
        try:
            for s in servers:
                start(s, keys, Path(tmp))
            results = asyncio.run(measure(servers, args))
        finally:
            for s in servers:
                stop(s)
    reference = reference_steps(results, args.reference_steps) if args.reference else {}
    report = {"machine_cores": os.cpu_count(), "config": vars(args), "results": results,
              "engine_level_decode_step_ms": reference}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(results, reference))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
