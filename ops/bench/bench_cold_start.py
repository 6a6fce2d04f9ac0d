"""Cold start to first token, with an empty native-op build cache and with a warm one.

    python3 -m ops.bench.bench_cold_start --rounds 1

Each round starts the gateway with one worker (the default model) twice, alternating: once
with a fresh, empty TORCH_EXTENSIONS_DIR (what a fresh machine without `ops/install.sh`'s
prebuild pays) and once with the cache the first start filled. Reports, per start, seconds from
start to the worker declared ready (model load + native build or load + warm-up step) and to
the first token of the first request; medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from gateway.auth import ApiKeys
from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig

KEY = "bench-key"


def one_start(extensions_dir: str) -> dict[str, float]:
    config = PoolConfig("bench", min_workers=1, max_workers=1, kv_cache_bytes=64 << 20,
                        start_timeout_s=900,
                        worker_threads=1,
                        worker_env=(("TORCH_EXTENSIONS_DIR", extensions_dir),))
    started = time.monotonic()
    runner = GatewayRunner([config], ApiKeys.parse(f"{KEY}=bench")).start(wait_ready=False)
    try:
        runner.call(runner.wait_ready(timeout_s=900), timeout_s=960)
        ready_s = time.monotonic() - started
        with Client(runner.target, api_key=KEY) as client:
            stream = client.generate("The capital of France is", max_tokens=1)
            next(iter(stream))
            first_token_s = time.monotonic() - started
            list(stream)
    finally:
        runner.stop()
    return {"ready_s": ready_s, "first_token_s": first_token_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tessera-ext-") as cache:
            runs["cold"].append(one_start(cache))
            runs["warm"].append(one_start(cache))
    print("| build cache | ready (s) | first token (s) |\n|---|---|---|")
    for kind, rows in runs.items():
        ready = statistics.median(r["ready_s"] for r in rows)
        first = statistics.median(r["first_token_s"] for r in rows)
        print(f"| {kind} | {ready:.1f} | {first:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
