"""KV transfer throughput and the TTFT it adds: colocated vs disaggregated, real processes.

`python -m ops.bench.bench_disagg [--prompt-tokens 1024] [--requests 8] [--decode-kv bf16]`

One gateway on loopback serves the default model twice: `colo` (one colocated worker) and
`pd` (one prefill worker, one decode worker; the KV moves between them over gRPC as
checksummed frames, runtime/disagg). Requests run one at a time, alternating which model goes
first, each with a fresh random-token prompt (no prefix-cache hit on either side). Reported:
medians of TTFT (send to first chunk), time to the second chunk (after the transfer, on `pd`)
and end-to-end; the decode worker's import totals (bytes, pages, seconds from first frame to
commit) give MB/s and pages/s, the prefill worker's export totals the sender's view.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway.auth import ApiKeys
from gateway.client import NO_RETRY, Client
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig


def _timed(client: Client, model: str, ids: list[int], max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    marks: list[float] = []
    for _ in client.generate(ids, model=model, max_tokens=max_tokens, temperature=0.0,
                             ignore_eos=True):
        marks.append(time.perf_counter() - t0)
    return {"ttft_s": marks[0], "second_s": marks[1], "e2e_s": marks[-1]}


def _status(runner: GatewayRunner, pool: object) -> wpb.StatusResponse:
    async def read() -> wpb.StatusResponse:
        return await pool.ready()[0].stub.Status(wpb.StatusRequest(), timeout=10)  # type: ignore[attr-defined]

    return runner.call(read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=8, help="per model")
    p.add_argument("--prefill-kv", default="bf16")
    p.add_argument("--decode-kv", default="bf16")
    p.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    p.add_argument("--out", default=None, help="write the raw results as JSON here")
    args = p.parse_args(argv)
    key = "bench-key"
    common = dict(kv_cache_bytes=args.kv_cache_bytes, max_inflight=4, min_workers=1,
                  max_workers=1)
    pools = [
        PoolConfig("colo", worker_args=("--kv-cache-dtype", args.decode_kv), **common),
        PoolConfig("pd", role="prefill", worker_args=("--kv-cache-dtype", args.prefill_kv),
                   **common),
        PoolConfig("pd", role="decode", worker_args=("--kv-cache-dtype", args.decode_kv),
                   **common),
    ]
    started = time.perf_counter()
    runner = GatewayRunner(pools, ApiKeys.parse(f"{key}=bench")).start()
    print(f"workers ready in {time.perf_counter() - started:.1f} s", flush=True)
    rng = random.Random(0)
    runs: dict[str, list[dict[str, float]]] = {"colo": [], "pd": []}
    try:
        with Client(runner.target, api_key=key, retry=NO_RETRY) as client:
            warm = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            for model in runs:  # first use of each path, not measured
                _timed(client, model, warm, 2)
            for i in range(args.requests):
                order = ["colo", "pd"] if i % 2 == 0 else ["pd", "colo"]
                for model in order:
                    ids = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
                    runs[model].append(_timed(client, model, ids, args.max_tokens))
        gw = runner.gateway
        assert gw is not None
        imp = _status(runner, gw.pools["pd"]).imported
        exp = _status(runner, gw.prefill_pools["pd"]).exported
    finally:
        runner.stop()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    result = {
        "args": vars(args), "medians": med, "runs": runs,
        "import": {"transfers": imp.transfers, "pages": imp.pages, "bytes": imp.bytes,
                   "frames": imp.frames, "duration_s": imp.duration_s,
                   "failures": dict(imp.failures)},
        "export": {"transfers": exp.transfers, "pages": exp.pages, "bytes": exp.bytes,
                   "frames": exp.frames, "duration_s": exp.duration_s},
    }
    print(f"{'':6} {'TTFT ms':>9} {'2nd chunk ms':>13} {'e2e ms':>9}")
    for m, v in med.items():
        print(f"{m:6} {v['ttft_s'] * 1e3:9.1f} {v['second_s'] * 1e3:13.1f} "
              f"{v['e2e_s'] * 1e3:9.1f}")
    print(f"added by disaggregation (medians): TTFT "
          f"{(med['pd']['ttft_s'] - med['colo']['ttft_s']) * 1e3:+.1f} ms, second chunk "
          f"{(med['pd']['second_s'] - med['colo']['second_s']) * 1e3:+.1f} ms")
    for side, t in (("import", imp), ("export", exp)):
        if t.duration_s > 0:
            print(f"{side}: {t.transfers} transfers, {t.bytes / 1e6:.1f} MB in {t.frames} "
                  f"frames, {t.pages} pages, {t.duration_s:.3f} s: "
                  f"{t.bytes / 1e6 / t.duration_s:.1f} MB/s, {t.pages / t.duration_s:.0f} "
                  f"pages/s, {t.duration_s / max(1, t.transfers) * 1e3:.1f} ms per transfer")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
