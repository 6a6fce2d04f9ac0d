"""The page tag/owner check's cost in disaggregated serving, as the reference measured it:
prefill and decode pools, long inputs, short outputs, concurrency 1 to 8; a ratio on/off with a
bootstrap 95% confidence interval over interleaved rounds. Real worker processes, loopback.

    python -m ops.bench.bench_pd_integrity [--rounds 4] [--concurrency 1 2 4 8] \
        [--input-len 1024] [--output-len 16] --out ops/bench/plots/pd_integrity_issue15.json

Two deployments behind one gateway, each a prefill worker + a decode worker on `--threads`
threads each: `on` (engine flag `--integrity tags`, the default) and `off` (`--integrity off`,
the no-op tracker), on both pools. Each round runs every concurrency level on both, in turns
(which goes first alternates by round and level), with fresh random-text prompts per (round,
level), the same for both deployments. A level is a closed loop of `--requests-per-slot` x
concurrency requests (`tessera bench serve`'s `run_level`). One unit = one (round, level): its
output tok/s ratio on/off and mean and p95 end-to-end latency ratios on/off. Per level and over
all levels: the geometric mean of the units' ratios, with a percentile bootstrap CI over units
(ops/eval/stats.py). A ratio of tok/s below 1 (latency above 1) is what the check costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ops.bench.bench_pd_mixed import API_KEY, WARMUP_SEED, pd_pools, start_gateway
from ops.bench.serving.backends import GrpcBackend
from ops.bench.serving.cli import machine_info, now_utc, prompt_maker
from ops.bench.serving.load import Level, run_level
from ops.bench.serving.metrics import summarize
from ops.eval.stats import bootstrap, exp_ratio

DEPLOYMENTS = {"on": ("--integrity", "tags"), "off": ("--integrity", "off")}
# what a unit reports -> how to read it from `summarize`'s metrics (ratio on/off per unit)
RATIOS = {
    "output_tok_s": lambda m: m["output_throughput"],
    "e2e_mean_ms": lambda m: m["e2e_ms"]["mean"],
    "e2e_p95_ms": lambda m: m["e2e_ms"]["p95"],
}


def unit_log_ratios(units: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per RATIOS key, log(on / off) of every unit ({"on": metrics, "off": metrics})."""
    return {k: [math.log(read(u["on"]) / read(u["off"])) for u in units]
            for k, read in RATIOS.items()}


def geomean_ci(log_ratios: Sequence[float], resamples: int = 2000,
               seed: int = 0) -> dict[str, float]:
    """Geometric mean of the ratios and its 95% percentile-bootstrap CI over the units."""
    units = np.array([[x, 1.0] for x in log_ratios])
    return bootstrap(units, exp_ratio(0, 1), resamples=resamples, seed=seed).as_dict()


def summarize_units(units: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency level and over all units: {ratio key: {value, lo, hi}} and n."""
    levels = sorted({u["concurrency"] for u in units})
    groups = {str(c): [u for u in units if u["concurrency"] == c] for c in levels}
    groups["all"] = list(units)
    return {name: {"n": len(us), **{k: geomean_ci(v)
                                    for k, v in unit_log_ratios(us).items()}}
            for name, us in groups.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests-per-slot", type=int, default=1)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="output tokens")
    p.add_argument("--threads", type=int, default=1, help="per worker")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per worker")
    p.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = p.parse_args(argv)
    if min(args.rounds, args.requests_per_slot, args.input_len, args.output_len, args.threads,
           *args.concurrency) < 1:
        p.error("rounds, concurrency, lengths and threads must be >= 1")
    return args


async def bench(args: argparse.Namespace, target: str) -> list[dict[str, Any]]:
    maker = prompt_maker(None)
    backends = {m: GrpcBackend(m, target, API_KEY, m) for m in DEPLOYMENTS}
    for b in backends.values():
        await b.open()
    units: list[dict[str, Any]] = []
    try:
        warm = maker.random_prompts(2, args.input_len, 2, seed=WARMUP_SEED)
        for b in backends.values():  # first use of each path, not measured
            for prompt in warm:
                if (r := await b.send(prompt, True)).error:
                    raise RuntimeError(f"{b.label}: warm-up failed: {r.error}")
        for i in range(args.rounds):
            for j, c in enumerate(args.concurrency):
                prompts = maker.random_prompts(c * args.requests_per_slot, args.input_len,
                                               args.output_len, seed=1000 * i + j)
                order = ["on", "off"] if (i + j) % 2 == 0 else ["off", "on"]
                unit: dict[str, Any] = {"round": i, "concurrency": c, "order": order}
                for m in order:
                    load = os.getloadavg()[0]
                    run = await run_level(backends[m], prompts, Level(concurrency=c),
                                          ignore_eos=True, max_duration_s=600,
                                          request_timeout_s=600)
                    unit[m] = summarize(run.results, run.duration_s)
                    unit[m]["load_average_before"] = load
                    if unit[m]["failed"]:
                        raise RuntimeError(f"{m} c={c}: {unit[m]['errors']}")
                units.append(unit)
                on, off = unit["on"], unit["off"]
                print(f"round {i} c={c}: tok/s on {on['output_throughput']:6.1f} off "
                      f"{off['output_throughput']:6.1f}, e2e mean on "
                      f"{on['e2e_ms']['mean']:7.0f} off {off['e2e_ms']['mean']:7.0f} ms, "
                      f"load {on['load_average_before']:.2f}", flush=True)
    finally:
        for b in backends.values():
            await b.close()
    return units


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = dict(kv_cache_bytes=args.kv_cache_bytes, max_inflight=32, min_workers=1,
                  max_workers=1)
    pools = [pool for name, flags in DEPLOYMENTS.items()
             for pool in pd_pools(name, args.threads, common, flags, flags)]
    result: dict[str, Any] = {"tool": "ops.bench.bench_pd_integrity", "args": vars(args),
                              "machine": machine_info(), "started_at": now_utc(),
                              "load_average_start": os.getloadavg()}
    runner = start_gateway(pools)
    try:
        result["units"] = asyncio.run(bench(args, runner.target))
        result["integrity_checks"] = integrity_checks(runner)
    finally:
        runner.stop()
    result["finished_at"] = now_utc()
    result["load_average_end"] = os.getloadavg()
    result["ratios_on_over_off"] = summary = summarize_units(result["units"])
    print(f"integrity checks run per worker: {result['integrity_checks']}")
    print(f"{'level':6} {'n':>3}  " + "  ".join(f"{k + ' on/off [95% CI]':>30}" for k in RATIOS))
    for name, row in summary.items():
        cells = [f"{row[k]['value']:.4f} [{row[k]['lo']:.4f}, {row[k]['hi']:.4f}]"
                 for k in RATIOS]
        print(f"{name:6} {row['n']:3d}  " + "  ".join(f"{c:>30}" for c in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def integrity_checks(runner: Any) -> dict[str, int]:
    """Each worker's count of integrity checks run (its Status), so `off` is seen to be off."""
    from gateway._proto.tessera.v1 import worker_pb2 as wpb

    gw = runner.gateway

    async def read() -> dict[str, int]:
        out = {}
        for role, pools in (("decode", gw.pools), ("prefill", gw.prefill_pools)):
            for name, pool in pools.items():
                st = await pool.ready()[0].stub.Status(wpb.StatusRequest(), timeout=10)
                out[f"{name}/{role}"] = st.integrity_checks
        return out

    return runner.call(read())


if __name__ == "__main__":
    raise SystemExit(main())
