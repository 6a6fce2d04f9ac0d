"""Gateway overhead and worker cold start.

    python3 -m ops.bench.bench_gateway --requests 200 --max-tokens 8

Starts the gateway with one worker (the default model), then sends the same request
alternately to the worker's unix socket directly and through the gateway (SDK -> loopback gRPC
-> auth -> router -> worker), one at a time, and reports p50/p99 of time to first token and of
total latency for each path, and the difference (the gateway's added latency). Cold start is
spawn-to-healthy of each worker the supervisor started, plus the first request on an empty
pool (spawn + load + first token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import grpc

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.auth import ApiKeys
from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig

PROMPT = "The capital of France is"
KEY = "bench-key"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def timed(chunks) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    for _ in chunks:
        if first is None:
            first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(xs, 50) * 1e3, 3),
            "p99_ms": round(percentile(xs, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}


def overhead(args: argparse.Namespace) -> dict:
    pool = PoolConfig("bench", kv_cache_bytes=args.kv_cache_bytes, min_workers=1, max_workers=1)
    with GatewayRunner([pool], ApiKeys.parse(f"{KEY}=bench")) as runner:
        worker = runner.gateway.pools["bench"].ready()[0]
        cold = list(runner.gateway.pools["bench"].stats.cold_starts_s)
        direct = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(f"unix:{worker.socket_path}"))
        client = Client(runner.target, api_key=KEY)
        opts = pb.SamplingOptions(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        paths = {
            "direct": lambda i: direct.Generate(wpb.WorkerGenerateRequest(
                request_id=f"d{i}", tenant="bench", text=PROMPT, sampling=opts)),
            "gateway": lambda i: client.generate(PROMPT, max_tokens=args.max_tokens,
                                                 temperature=0.0, ignore_eos=True),
        }
        for i in range(args.warmup):
            for call in paths.values():
                timed(call(f"w{i}"))
        ttft: dict[str, list[float]] = {k: [] for k in paths}
        total: dict[str, list[float]] = {k: [] for k in paths}
        for i in range(args.requests):
            order = list(paths) if i % 2 == 0 else list(reversed(paths))
            for name in order:
                first, whole = timed(paths[name](i))
                ttft[name].append(first)
                total[name].append(whole)
        client.close()
    added = {m: {q: round(summary(d["gateway"])[q] - summary(d["direct"])[q], 3)
                 for q in ("p50_ms", "p99_ms", "mean_ms")}
             for m, d in (("ttft", ttft), ("total", total))}
    # Paired: each gateway request minus the direct request sent next to it (less drift).
    paired = [g - d for g, d in zip(total["gateway"], total["direct"], strict=True)]
    added["total_paired"] = {"p50_ms": round(percentile(paired, 50) * 1e3, 3),
                             "p99_ms": round(percentile(paired, 99) * 1e3, 3)}
    return {"requests": args.requests, "max_tokens": args.max_tokens,
            "ttft": {k: summary(v) for k, v in ttft.items()},
            "total": {k: summary(v) for k, v in total.items()},
            "gateway_added": added, "cold_start_s": [round(c, 3) for c in cold]}


def cold_first_request(args: argparse.Namespace) -> dict:
    pool = PoolConfig("bench", kv_cache_bytes=args.kv_cache_bytes, min_workers=0, max_workers=1)
    with GatewayRunner([pool], ApiKeys.parse(f"{KEY}=bench")) as runner:
        client = Client(runner.target, api_key=KEY)
        first, _ = timed(client.generate(PROMPT, max_tokens=args.max_tokens))
        spawn = runner.gateway.pools["bench"].stats.cold_starts_s
        client.close()
    return {"first_token_from_empty_pool_s": round(first, 3),
            "spawn_to_healthy_s": round(spawn[0], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200, help="per path")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--cold-starts", type=int, default=3, help="first requests on empty pools")
    ap.add_argument("--out", default="ops/bench/out/gateway.json")
    args = ap.parse_args()
    report = overhead(args)
    print(json.dumps(report, indent=2), flush=True)
    report["cold"] = [cold_first_request(args) for _ in range(args.cold_starts)]
    print(json.dumps(report["cold"], indent=2), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
