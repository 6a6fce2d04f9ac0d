"""Peers side by side: start each OpenAI-compatible server from its command line, one at a time,
time its cold start, read its memory at idle, then run `tessera bench serve` against all of them
interleaved while sampling their memory under load.

    python3 -m ops.bench.peers --out ops/bench/out/peers.json \
        --server 'tessera=python3 -m ops.cli serve --grpc-port 0 --http-port {port}' \
        --server 'llama.cpp=llama-server -m MODEL.gguf -t 2 -np 32 -c 8192 --port {port}' \
        -- --concurrency 1 8 32 --input-len 64 --output-len 64

`{port}` in a command becomes a free loopback port; the base URL is `http://127.0.0.1:{port}/v1`.
Everything after `--` goes to `tessera bench serve` unchanged (its JSON is written beside
`--out`). Cold start = from spawning the command to the first successful one-token
`/v1/completions` answer (weights loaded, kernels ready, the first request served). RSS is the
resident set of the server's whole process tree (gateway plus workers for tessera), in MiB:
idle is read after the readiness request and a settle pause; under load is the largest sample
(every 0.5 s) over the whole benchmark run, which drives each server in turn. PSS at idle counts
shared libraries once across the tree, where summed RSS counts them once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psutil

from ops.bench.soak import free_port


@dataclass
class Peer:
    label: str
    command: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None  # the server's stdout and stderr, open while it runs
    cold_start_s: float = 0.0
    rss_idle_mib: float = 0.0
    pss_idle_mib: float = 0.0
    rss_samples: list[tuple[float, float]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def tree_rss_mib(self) -> float:
        return self._tree_mib(lambda p: p.memory_info().rss)

    def tree_pss_mib(self) -> float:
        """Proportional set size: shared libraries counted once across the tree, where summing
        RSS counts them once per process (a cost only a multi-process server pays)."""
        return self._tree_mib(lambda p: p.memory_full_info().pss)

    def _tree_mib(self, size: Callable[[psutil.Process], int]) -> float:
        if self.proc is None:
            return 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for p in procs:
            try:
                total += size(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total / 2**20


def parse_server(spec: str) -> Peer:
    label, sep, command = spec.partition("=")
    if not sep or not label or not command:
        raise SystemExit(f"--server wants LABEL=COMMAND, got {spec!r}")
    port = free_port()
    return Peer(label, shlex.split(command.replace("{port}", str(port))), port)


def start(peer: Peer, api_key: str | None, log_dir: Path, timeout_s: float) -> None:
    """Spawn the peer and wait until a one-token completion succeeds; raises TimeoutError."""
    log = peer.log = open(log_dir / f"{peer.label}.log", "wb")
    t0 = time.perf_counter()
    peer.proc = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=peer.base_url, headers=headers, timeout=30) as http:
        while time.perf_counter() - t0 < timeout_s:
            if peer.proc.poll() is not None:
                raise RuntimeError(f"{peer.label} exited with {peer.proc.returncode}; "
                                   f"see {log.name}")
            try:
                model = http.get("/models").json()["data"][0]["id"]
                r = http.post("/completions", json={"model": model, "prompt": "Hello",
                                                    "max_tokens": 1})
                if r.status_code == 200:
                    peer.cold_start_s = time.perf_counter() - t0
                    return
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.25)
    raise TimeoutError(f"{peer.label} not ready after {timeout_s} s")


def stop(peer: Peer) -> None:
    if peer.proc is not None and peer.proc.poll() is None:
        os.killpg(peer.proc.pid, signal.SIGTERM)
        try:
            peer.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(peer.proc.pid, signal.SIGKILL)
            peer.proc.wait()
    if peer.log is not None:
        peer.log.close()


def sample_rss(peers: list[Peer], stop_event: threading.Event, every_s: float = 0.5) -> None:
    while not stop_event.wait(every_s):
        now = time.time()
        for peer in peers:
            peer.rss_samples.append((now, peer.tree_rss_mib()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", required=True, metavar="LABEL=COMMAND")
    p.add_argument("--out", type=Path, required=True, help="JSON of cold start and RSS")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"))
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    args = p.parse_args(ours)
    peers = [parse_server(s) for s in args.server]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bench_out = args.out.with_name(args.out.stem + "_serve.json")
    try:
        for peer in peers:  # NOTE: one at a time, so no cold start competes with another
            start(peer, args.api_key, args.out.parent, args.ready_timeout_s)
            time.sleep(args.settle_s)
            peer.rss_idle_mib = peer.tree_rss_mib()
            peer.pss_idle_mib = peer.tree_pss_mib()
            print(f"{peer.label}: ready in {peer.cold_start_s:.1f} s, idle RSS "
                  f"{peer.rss_idle_mib:.0f} MiB, PSS {peer.pss_idle_mib:.0f} MiB", flush=True)
        done = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(peers, done), daemon=True)
        sampler.start()
        bench = [sys.executable, "-m", "ops.cli", "bench", "serve", "--backend", "openai",
                 *(a for peer in peers for a in ("--base-url", f"{peer.label}={peer.base_url}")),
                 *(["--api-key", args.api_key] if args.api_key else []),
                 "--out", str(bench_out), *bench_args]
        rc = subprocess.call(bench)
        done.set()
        sampler.join()
    finally:
        for peer in peers:
            stop(peer)
    report = {peer.label: {"command": shlex.join(peer.command), "cold_start_s": peer.cold_start_s,
                           "rss_idle_mib": peer.rss_idle_mib, "pss_idle_mib": peer.pss_idle_mib,
                           "rss_load_max_mib": max((r for _, r in peer.rss_samples), default=0.0),
                           "rss_samples": peer.rss_samples}
              for peer in peers}
    args.out.write_text(json.dumps({"serve_json": str(bench_out), "peers": report}, indent=1))
    for label, r in report.items():
        print(f"{label}: cold start {r['cold_start_s']:.1f} s, RSS idle "
              f"{r['rss_idle_mib']:.0f} MiB (PSS {r['pss_idle_mib']:.0f}), "
              f"under load max {r['rss_load_max_mib']:.0f} MiB")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
