"""Cost of the page-integrity check, and what the prefix cache buys on a long shared prefix.

    python3 -m ops.bench.bench_integrity --pairs 4

Runs the same workload with the `tags` tracker and with `off`, interleaved (tags, off, off,
tags, ...) on one engine, and reports throughput and p95 inter-token latency per run, the
median ratio and a bootstrap 95% interval. Then measures time to first token of a prompt
whose 2,000-token prefix is cached (same tenant) vs uncached (cache cleared), and for another
tenant sending the same prompt (which must not benefit). The A/B ratio is noisy on a shared
machine; the tracker also times its own check, reported as a share of each run's wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path

from ops.bench.workload import make_workload, pydoc_paragraphs
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.integrity import TRACKERS
from runtime.sampling_params import SamplingParams


def timed_run(engine: LLMEngine, prompts: list[str], max_tokens: int) -> dict:
    stamps: dict[str, list[float]] = {}
    counters = engine.tracker.counters
    checks0, check_s0 = counters.checks_run, counters.check_time_s
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"i{i}-{start}"
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True))
        stamps[rid] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps[out.request_id].append(time.perf_counter())
    wall = time.perf_counter() - start
    gaps = [b - a for s in stamps.values() for a, b in itertools.pairwise(s)]
    tokens = sum(len(s) for s in stamps.values())
    return {"tok_s": tokens / wall, "itl_p95_ms": 1e3 * statistics.quantiles(gaps, n=20)[-1],
            "checks": counters.checks_run - checks0,
            "check_share_of_wall": (counters.check_time_s - check_s0) / wall}


def bootstrap_ci(xs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps)]


def ttft(engine: LLMEngine, prompt: str, tenant: str) -> tuple[float, int]:
    rid = f"t{time.perf_counter()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant=tenant)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return time.perf_counter() - start, out.num_cached_tokens


def long_prefix(engine: LLMEngine, num_tokens: int) -> str:
    text = " ".join(pydoc_paragraphs())
    ids = engine.tokenizer.encode(text)[:num_tokens]
    return engine.tokenizer.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--out", default="ops/bench/out/integrity.json")
    args = ap.parse_args()
    engine = LLMEngine.from_path(None, EngineConfig(kv_cache_bytes=1 << 30,
                                                    max_num_seqs=args.concurrency))
    prompts = [r.prompt for r in make_workload(args.concurrency, seed=7)]
    timed_run(engine, prompts[:4], 8)  # warm up
    runs: dict[str, list[dict]] = {"tags": [], "off": []}
    order = ["tags", "off", "off", "tags"] * ((args.pairs + 1) // 2)
    for name in order[: 2 * args.pairs]:
        engine.tracker = TRACKERS[name](engine.pool)
        engine.prefix_cache.clear()
        runs[name].append(timed_run(engine, prompts, args.max_tokens))
        print(name, json.dumps(runs[name][-1]), flush=True)
    pairs = list(zip(runs["tags"], runs["off"], strict=True))
    tput_ratio = [t["tok_s"] / o["tok_s"] for t, o in pairs]
    p95_ratio = [t["itl_p95_ms"] / o["itl_p95_ms"] for t, o in pairs]
    engine.tracker = TRACKERS["tags"](engine.pool)

    prefix = long_prefix(engine, args.prefix_tokens)
    cold, warm, other = [], [], []
    for i in range(3):
        engine.prefix_cache.clear()
        cold.append(ttft(engine, prefix + f" Question {i}: what is this about?", "acme"))
        warm.append(ttft(engine, prefix + f" Question {i + 10}: summarise it.", "acme"))
        other.append(ttft(engine, prefix + f" Question {i + 10}: summarise it.", "globex"))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "runs": runs,
        "throughput_ratio_tags_over_off": {"median": statistics.median(tput_ratio),
                                           "ci95": bootstrap_ci(tput_ratio)},
        "p95_itl_ratio_tags_over_off": {"median": statistics.median(p95_ratio),
                                        "ci95": bootstrap_ci(p95_ratio)},
        "check_share_of_wall_tags": statistics.median(r["check_share_of_wall"]
                                                     for r in runs["tags"]),
        "ttft_s": {"uncached": [c[0] for c in cold], "cached_same_tenant": [w[0] for w in warm],
                   "other_tenant": [o[0] for o in other]},
        "cached_tokens": {"uncached": cold[0][1], "cached_same_tenant": warm[0][1],
                          "other_tenant": other[0][1]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("check_share_of_wall_tags",
                                             "throughput_ratio_tags_over_off",
                                             "p95_itl_ratio_tags_over_off", "ttft_s",
                                             "cached_tokens")}, indent=1))


if __name__ == "__main__":
    main()
