"""Colocated vs disaggregated serving under a mixed workload: do long prefills stall other
sequences' decode? Real worker processes, one gateway on loopback, the default model.

    python -m ops.bench.bench_pd_mixed [--rounds 4] [--chat-clients 4] [--long-requests 4] \
        [--long-every-s 8] [--long-input 1536] --out ops/bench/plots/pd_mixed_issue15.json

Deployment `colo`: one colocated worker (role `both`) on `--colo-threads` CPU threads.
Deployment `pd`: one prefill worker and one decode worker on `--pd-threads` threads each (the
KV moves between them, runtime/disagg). Both sit behind the same gateway; only one is driven at
a time, rounds alternate which goes first. One run offers both deployments the same work:
`--chat-clients` streaming clients each send `--chat-requests` short-prompt, long-output
requests one after another (their inter-token latency is the quantity of interest) while
`--long-requests` long-prompt, short-output requests arrive every `--long-every-s` seconds from
the start (an open loop: a deployment that falls behind queues them). Prompts are random text
(no prefix-cache hit), fresh every round, the same for both deployments within a round.
Reported per run: output tok/s over all requests (first send to last reply), the chat streams'
ITL p50/p95 and TTFT, the long requests' TTFT; then medians over rounds and the median of the
per-round pd/colo ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from gateway.auth import ApiKeys
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig
from ops.bench.serving.backends import GrpcBackend
from ops.bench.serving.cli import machine_info, now_utc, prompt_maker
from ops.bench.serving.metrics import RequestResult, summarize
from ops.bench.serving.prompts import BenchPrompt

API_KEY = "bench-key"
# NOTE: far from every round's seeds; random.Random(-n) == random.Random(n), so warm-up prompts
# from a negative seed were a measured level's prompts again (prefix-cache hits).
WARMUP_SEED = 10**9


def start_gateway(pools: Sequence[PoolConfig]) -> GatewayRunner:
    """A gateway on a free loopback port with every pool's workers ready; one API key."""
    started = time.perf_counter()
    runner = GatewayRunner(pools, ApiKeys.parse(f"{API_KEY}=bench")).start()
    print(f"workers ready in {time.perf_counter() - started:.1f} s", flush=True)
    return runner


def pd_pools(model_id: str, threads: int, common: dict[str, Any],
             prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()
             ) -> list[PoolConfig]:
    """One prefill worker and one decode worker serving `model_id`, `threads` threads each."""
    return [PoolConfig(model_id, role=role, worker_threads=threads, worker_args=extra, **common)
            for role, extra in (("prefill", prefill_args), ("decode", decode_args))]


def load_average() -> float:
    return os.getloadavg()[0]


async def mixed_run(backend: GrpcBackend, chat: Sequence[Sequence[BenchPrompt]],
                    long: Sequence[BenchPrompt], long_every_s: float) -> dict[str, Any]:
    """`chat[i]`: client i's requests, sent one after another; `long[k]` is sent at
    k * `long_every_s` seconds after the start, whatever is still running."""

    async def chat_client(prompts: Sequence[BenchPrompt]) -> list[RequestResult]:
        return [await backend.send(p, True) for p in prompts]

    async def long_request(k: int, prompt: BenchPrompt) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + k * long_every_s - time.perf_counter()))
        return await backend.send(prompt, True)

    load_before = load_average()
    t0 = time.perf_counter()
    longs = asyncio.gather(*(long_request(k, p) for k, p in enumerate(long)))
    chats = await asyncio.gather(*(chat_client(c) for c in chat))
    chat_s = time.perf_counter() - t0
    long_results = list(await longs)
    total_s = time.perf_counter() - t0
    chat_results = [r for rs in chats for r in rs]
    everything = summarize(chat_results + long_results, total_s)
    return {"load_average_before": load_before, "load_average_after": load_average(),
            "total_s": total_s, "chat_s": chat_s,
            "output_tok_s": everything["output_throughput"],
            "failed": everything["failed"], "errors": everything["errors"],
            "chat": summarize(chat_results, chat_s), "long": summarize(long_results, total_s)}


KEYS = {  # name in the tables -> how to read it from one run
    "output_tok_s": lambda r: r["output_tok_s"],
    "chat_itl_p50_ms": lambda r: r["chat"]["itl_ms"]["median"],
    "chat_itl_p95_ms": lambda r: r["chat"]["itl_ms"]["p95"],
    "chat_itl_p99_ms": lambda r: r["chat"]["itl_ms"]["p99"],
    "chat_ttft_p50_ms": lambda r: r["chat"]["ttft_ms"]["median"],
    "chat_tok_s": lambda r: r["chat"]["output_throughput"],
    "long_ttft_p50_ms": lambda r: r["long"]["ttft_ms"]["median"],
    "long_ttft_p95_ms": lambda r: r["long"]["ttft_ms"]["p95"],
    "total_s": lambda r: r["total_s"],
}


def medians(runs: Sequence[dict[str, Any]], a: str = "colo", b: str = "pd") -> dict[str, Any]:
    """Per deployment, each key's median over rounds; and the median of per-round b/a ratios.
    `runs` holds one dict per round: {deployment: run}. Keys with a missing value are skipped."""
    out: dict[str, Any] = {a: {}, b: {}, f"{b}/{a}": {}}
    for key, read in KEYS.items():
        for dep in (a, b):
            vals = [read(r[dep]) for r in runs if read(r[dep]) is not None]
            out[dep][key] = statistics.median(vals) if vals else None
        ratios = [read(r[b]) / read(r[a]) for r in runs if read(r[a]) and read(r[b]) is not None]
        out[f"{b}/{a}"][key] = statistics.median(ratios) if ratios else None
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--chat-clients", type=int, default=4)
    p.add_argument("--chat-requests", type=int, default=2, help="per chat client, in turn")
    p.add_argument("--chat-input", type=int, default=32, help="prompt tokens")
    p.add_argument("--chat-output", type=int, default=96, help="output tokens")
    p.add_argument("--long-requests", type=int, default=4, help="per run")
    p.add_argument("--long-every-s", type=float, default=8.0, help="between long arrivals")
    p.add_argument("--long-input", type=int, default=1536, help="prompt tokens")
    p.add_argument("--long-output", type=int, default=8, help="output tokens")
    p.add_argument("--colo-threads", type=int, default=2)
    p.add_argument("--pd-threads", type=int, default=1, help="per pd worker")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="per worker")
    p.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = p.parse_args(argv)
    if min(args.rounds, args.chat_clients, args.chat_requests, args.chat_input,
           args.chat_output, args.long_requests, args.long_input, args.long_output,
           args.colo_threads, args.pd_threads) < 1 or not args.long_every_s >= 0:
        p.error("every count, length and thread number must be >= 1, --long-every-s >= 0")
    return args


async def bench(args: argparse.Namespace, target: str) -> list[dict[str, Any]]:
    maker = prompt_maker(None)
    backends = {m: GrpcBackend(m, target, API_KEY, m) for m in ("colo", "pd")}
    for b in backends.values():
        await b.open()
    rounds: list[dict[str, Any]] = []
    try:
        warm_chat = maker.random_prompts(1, args.chat_input, 4, seed=WARMUP_SEED)
        warm_long = maker.random_prompts(1, args.long_input, 2, seed=WARMUP_SEED + 1)
        for b in backends.values():  # first use of each path, not measured
            for prompt in warm_chat + warm_long:
                r = await b.send(prompt, True)
                if r.error:
                    raise RuntimeError(f"{b.label}: warm-up failed: {r.error}")
        for i in range(args.rounds):
            chat_flat = maker.random_prompts(args.chat_clients * args.chat_requests,
                                             args.chat_input, args.chat_output, seed=10 * i)
            chat = [chat_flat[c::args.chat_clients] for c in range(args.chat_clients)]
            long = maker.random_prompts(args.long_requests, args.long_input,
                                        args.long_output, seed=10 * i + 1)
            order = ["colo", "pd"] if i % 2 == 0 else ["pd", "colo"]
            this: dict[str, Any] = {"round": i, "order": order, "started_at": now_utc()}
            for m in order:
                run = this[m] = await mixed_run(backends[m], chat, long, args.long_every_s)
                print(f"round {i} {m:4}: {run['output_tok_s']:6.1f} out tok/s, chat ITL p50/p95 "
                      f"{run['chat']['itl_ms']['median'] or 0:7.1f} / "
                      f"{run['chat']['itl_ms']['p95'] or 0:7.1f} ms, long TTFT p50 "
                      f"{run['long']['ttft_ms']['median'] or 0:7.0f} ms, "
                      f"{run['total_s']:5.1f} s, {run['failed']} failed, "
                      f"load {run['load_average_before']:.2f}->"
                      f"{run['load_average_after']:.2f}", flush=True)
            rounds.append(this)
    finally:
        for b in backends.values():
            await b.close()
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = dict(kv_cache_bytes=args.kv_cache_bytes, max_inflight=32, min_workers=1,
                  max_workers=1)
    pools = [PoolConfig("colo", worker_threads=args.colo_threads, **common),
             *pd_pools("pd", args.pd_threads, common)]
    result: dict[str, Any] = {"tool": "ops.bench.bench_pd_mixed", "args": vars(args),
                              "machine": machine_info(), "started_at": now_utc(),
                              "load_average_start": os.getloadavg()}
    runner = start_gateway(pools)
    try:
        result["rounds"] = asyncio.run(bench(args, runner.target))
    finally:
        runner.stop()
    result["finished_at"] = now_utc()
    result["load_average_end"] = os.getloadavg()
    result["medians"] = med = medians(result["rounds"])
    print(f"{'median over rounds':22} {'colo':>10} {'pd':>10} {'pd/colo':>8}")
    for key in KEYS:
        cells = [med[d][key] for d in ("colo", "pd", "pd/colo")]
        print(f"{key:22} " + " ".join("      None" if v is None else f"{v:10.2f}"
                                      for v in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
