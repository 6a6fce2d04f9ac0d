"""Soak: a bounded stretch of mixed, impatient traffic against a real `tessera serve`, watching
for growth in memory and for pages that never come back.

    python3 -m ops.bench.soak --duration-s 300 --concurrency 8 --out ops/bench/out/soak.json

Starts `tessera serve` (gateway, one worker, the REST shim) on loopback ports, then keeps
`--concurrency` clients busy for `--duration-s` seconds (at most `--max-requests`), each
request drawn from: a full answer over gRPC, a full answer over REST (OpenAI streaming), a
stream closed after its first token, a deadline that fires mid-prefill or mid-decode, and
multi-turn sessions whose prompt grows each turn (prefix-cache reuse). Every `--sample-s`
seconds it records the resident set size (RSS, MiB) of the gateway process and of each worker,
and the worker's KV pages (used, cached, free) from `/status`.

Verdict: memory is flat when the least-squares slope of RSS over the second half of the run is
under `--max-slope-mib-per-min` for every process; no page leaked when, after the traffic stops
and the worker is idle, no page is held (free + cached = total).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from gateway.client import AsyncClient, RetryPolicy, TesseraError

KEY, OPERATOR = "soak-key", "soak-operator"
TOPICS = ("tides", "bread", "compilers", "glaciers", "chess", "rivers", "owls", "trains")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sample:
    t_s: float
    rss_mib: dict[str, float]
    pages: dict[str, int]


@dataclass
class Soak:
    outcomes: Counter[str] = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)


class Server:
    """`tessera serve` as a child process, in its own process group."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.keys = Path(tempfile.mkdtemp(prefix="tessera-soak-")) / "keys"
        self.keys.write_text(f"{KEY}=soak\n")
        cmd = [sys.executable, "-m", "ops.cli", "serve", "--api-keys", str(self.keys),
               "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
               "--operator-key", OPERATOR, "--kv-cache-bytes", str(args.kv_cache_bytes),
               "--max-inflight", str(args.concurrency)]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=open(self.keys.parent / "serve.log", "wb"))
        self.http = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tessera serve exited {self.proc.returncode}; see "
                                   f"{self.keys.parent / 'serve.log'}")
            with contextlib.suppress(httpx.HTTPError):
                workers = self.status()["gateway"]["pools"][0]["workers"]
                if workers and all("pages_total" in w for w in workers):
                    return
            time.sleep(1.0)
        raise TimeoutError("tessera serve was not ready in time")

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.http}/status", timeout=10,
                      headers={"Authorization": f"Bearer {OPERATOR}"})
        r.raise_for_status()
        return r.json()

    def rss_mib(self) -> dict[str, float]:
        gateway = psutil.Process(self.proc.pid)
        out = {"gateway": gateway.memory_info().rss / 2**20}
        for child in gateway.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                out[f"worker:{child.pid}"] = child.memory_info().rss / 2**20
        return out

    def pages(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for w in self.status()["gateway"]["pools"][0]["workers"]:
            for k in ("pages_total", "pages_used", "pages_cached", "pages_free", "running",
                      "waiting"):
                total[k] += int(w.get(k, 0))
        # NOTE: /status counts cached pages as used; held = pages no request should still own.
        total["pages_held"] = total["pages_total"] - total["pages_free"] - total["pages_cached"]
        return dict(total)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def one_request(kind: str, rng: random.Random, grpc: AsyncClient, http: httpx.AsyncClient,
                      model: str) -> str:
    topic = rng.choice(TOPICS)
    prompt = f"Write a few sentences about {topic}. " * rng.randint(1, 12)
    max_tokens = rng.randint(8, 48)
    try:
        if kind == "grpc_full":
            stream = grpc.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
            async for _ in stream:
                pass
        elif kind == "grpc_close_after_first":
            stream = grpc.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
            async for _ in stream:
                break
            stream.cancel()
        elif kind == "grpc_deadline":
            stream = grpc.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
            async with asyncio.timeout(rng.uniform(0.05, 1.5)):
                async for _ in stream:
                    pass
        elif kind == "grpc_server_deadline":
            stream = grpc.generate(prompt, max_tokens=max_tokens, ignore_eos=True,
                                   timeout_s=rng.uniform(0.05, 1.5))
            async for _ in stream:
                pass
        elif kind == "rest_full":
            body = {"model": model, "stream": True, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": prompt}]}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for _ in r.aiter_lines():
                    pass
        elif kind == "rest_disconnect":
            body = {"model": model, "stream": True, "max_tokens": max_tokens, "prompt": prompt}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
        elif kind == "session":
            session = f"soak-{rng.randrange(1 << 30)}"
            history = ""
            for turn in range(rng.randint(2, 4)):
                history += f"Turn {turn}: tell me about {rng.choice(TOPICS)}. "
                async for _ in grpc.generate(history, session=session, max_tokens=8,
                                             ignore_eos=True):
                    pass
    except TimeoutError:
        return f"{kind}:client_deadline"
    except TesseraError as e:
        return f"{kind}:{e.reason}"
    except httpx.HTTPStatusError as e:
        return f"{kind}:http_{e.response.status_code}"
    return f"{kind}:ok"


KINDS = ("grpc_full", "rest_full", "grpc_close_after_first", "grpc_deadline",
         "grpc_server_deadline", "rest_disconnect", "session")


async def drive(server: Server, args: argparse.Namespace, soak: Soak) -> None:
    rng = random.Random(args.seed)
    model = server.status()["gateway"]["pools"][0]["model"]
    end = time.monotonic() + args.duration_s
    sent = 0
    no_retry = RetryPolicy(max_attempts=1)
    async with AsyncClient(f"127.0.0.1:{server.grpc_port}", KEY, retry=no_retry) as grpc, \
            httpx.AsyncClient(base_url=server.http, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as http:

        async def client(i: int) -> None:
            nonlocal sent
            local = random.Random(rng.random() + i)
            while time.monotonic() < end and sent < args.max_requests:
                sent += 1
                soak.outcomes[await one_request(local.choice(KINDS), local, grpc, http, model)] += 1

        async def sampler() -> None:
            start = time.monotonic()
            while time.monotonic() < end and sent < args.max_requests:
                pages = await asyncio.to_thread(server.pages)
                soak.samples.append(Sample(round(time.monotonic() - start, 1),
                                           server.rss_mib(), pages))
                await asyncio.sleep(args.sample_s)

        await asyncio.gather(sampler(), *(client(i) for i in range(args.concurrency)))


def slope_mib_per_min(samples: list[Sample], name: str) -> float:
    half = samples[len(samples) // 2:]
    pts = [(s.t_s, s.rss_mib[name]) for s in half if name in s.rss_mib]
    if len(pts) < 3:
        return float("nan")
    t, rss = np.array(pts).T
    return float(np.polyfit(t / 60.0, rss, 1)[0])


def idle_pages(server: Server, timeout_s: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    pages = server.pages()
    while (pages["running"] or pages["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        pages = server.pages()
    return pages


def report(soak: Soak, idle: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    names = sorted({n for s in soak.samples for n in s.rss_mib})
    procs = {}
    for name in names:
        series = [s.rss_mib[name] for s in soak.samples if name in s.rss_mib]
        procs[name] = {"rss_first_mib": round(series[0], 1), "rss_last_mib": round(series[-1], 1),
                       "rss_max_mib": round(max(series), 1),
                       "slope_2nd_half_mib_per_min": round(slope_mib_per_min(soak.samples, name),
                                                           2)}
    flat = all(abs(p["slope_2nd_half_mib_per_min"]) < args.max_slope_mib_per_min
               for p in procs.values())
    return {"duration_s": args.duration_s, "concurrency": args.concurrency,
            "requests": sum(soak.outcomes.values()),
            "outcomes": dict(sorted(soak.outcomes.items())),
            "processes": procs, "memory_flat": flat,
            "pages_at_idle": idle, "page_leak": idle["pages_held"] != 0,
            "samples": [asdict(s) for s in soak.samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=300)
    ap.add_argument("--max-requests", type=int, default=5000, help="a bound on the whole run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-slope-mib-per-min", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="ops/bench/out/soak.json")
    args = ap.parse_args()
    server = Server(args)
    try:
        server.wait_ready(600)
        soak = Soak()
        asyncio.run(drive(server, args, soak))
        result = report(soak, idle_pages(server), args)
    finally:
        server.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if not result["memory_flat"] or result["page_leak"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
