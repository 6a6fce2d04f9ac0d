"""The statistics and argument checks of the issue-15 benches (ops/bench/bench_pd_mixed.py,
ops/bench/bench_pd_integrity.py) on synthetic runs; the benches themselves need real workers
and minutes, so they are run by hand (ops/bench/RESULTS.md#serving)."""

from __future__ import annotations

import math
import random

import pytest

from ops.bench.bench_pd_integrity import geomean_ci, summarize_units
from ops.bench.bench_pd_integrity import parse_args as integrity_args
from ops.bench.bench_pd_mixed import medians
from ops.bench.bench_pd_mixed import parse_args as mixed_args


def mixed_run(tok_s: float, itl_p95_ms: float) -> dict:
    dist = {"mean": 1.0, "median": 1.0, "p95": itl_p95_ms, "p99": itl_p95_ms}
    return {"output_tok_s": tok_s,
            "chat": {"itl_ms": dist, "ttft_ms": dist, "output_throughput": tok_s},
            "long": {"ttft_ms": {**dist, "median": None}}, "total_s": 10.0}


def test_mixed_medians_are_over_rounds_and_ratios_per_round():
    runs = [{"colo": mixed_run(10, 900), "pd": mixed_run(8, 100)},
            {"colo": mixed_run(20, 800), "pd": mixed_run(22, 200)},
            {"colo": mixed_run(30, 1000), "pd": mixed_run(30, 50)}]
    med = medians(runs)
    assert med["colo"]["output_tok_s"] == 20 and med["pd"]["output_tok_s"] == 22
    # per-round ratios 0.8, 1.1, 1.0: their median, not the ratio of medians (1.1)
    assert med["pd/colo"]["output_tok_s"] == pytest.approx(1.0)
    assert med["pd/colo"]["chat_itl_p95_ms"] == pytest.approx(100 / 900)
    assert med["colo"]["long_ttft_p50_ms"] is None  # no value in any round: None, not 0


def unit(c: int, on_tok_s: float, off_tok_s: float) -> dict:
    def metrics(tok_s: float) -> dict:
        e2e = 1000.0 / tok_s
        return {"output_throughput": tok_s, "e2e_ms": {"mean": e2e, "p95": 2 * e2e}}

    return {"concurrency": c, "on": metrics(on_tok_s), "off": metrics(off_tok_s)}


def test_integrity_ratio_is_the_geometric_mean_with_a_ci_around_it():
    rng = random.Random(0)
    units = [unit(c, 100 * 0.97 * math.exp(rng.gauss(0, 0.01)), 100.0)
             for c in (1, 2, 4, 8) for _ in range(6)]
    summary = summarize_units(units)
    assert set(summary) == {"1", "2", "4", "8", "all"} and summary["all"]["n"] == 24
    tok = summary["all"]["output_tok_s"]
    assert tok["lo"] < tok["value"] < tok["hi"] and 0.96 < tok["lo"] and tok["hi"] < 0.98
    # latency here is exactly 1/throughput, so its ratio is the throughput ratio's inverse
    assert summary["all"]["e2e_mean_ms"]["value"] == pytest.approx(1 / tok["value"])
    assert geomean_ci([math.log(2.0)] * 5) == {"value": 2.0, "lo": 2.0, "hi": 2.0}


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--concurrency", "1", "0"],
                                  ["--threads", "0"]])
def test_integrity_bench_refuses_non_positive_counts(argv):
    with pytest.raises(SystemExit):
        integrity_args(argv)


def test_mixed_bench_refuses_non_positive_counts_and_keeps_defaults():
    with pytest.raises(SystemExit):
        mixed_args(["--long-requests", "0"])
    args = mixed_args([])
    assert (args.colo_threads, args.pd_threads) == (2, 1)  # the same two cores either way
