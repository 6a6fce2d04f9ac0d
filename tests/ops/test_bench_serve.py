"""`tessera bench serve`: the metric math on synthetic timings, the load shapes, and one short
real run against a real gateway on loopback, over gRPC and over the REST shim's OpenAI routes."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ops.bench.serving.load import Level, arrival_times, run_level
from ops.bench.serving.metrics import (
    RequestResult,
    meets_slos,
    parse_slos,
    percentile,
    summarize,
)
from ops.bench.serving.prompts import BenchPrompt


def ok(ttft_s: float, e2e_s: float, output_tokens: int, gaps: list[float] | None = None,
       prompt_tokens: int = 100, cached: int | None = None) -> RequestResult:
    return RequestResult(prompt_tokens, output_tokens, ttft_s, e2e_s, gaps or [], cached)


def test_percentiles_interpolate_between_ranks_like_numpy():
    rng = random.Random(3)
    for n in (1, 2, 7, 100, 1001):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_decode_time_over_the_tokens_after_the_first():
    assert ok(0.2, 1.2, 11).tpot_s == pytest.approx(0.1)
    assert ok(0.2, 0.2, 1).tpot_s is None  # one token: no decode interval
    assert RequestResult(10, 5, 0.1, 0.5, error="OVERLOADED").tpot_s is None


def test_summary_of_synthetic_timings():
    results = [ok(0.1, 1.1, 11, [0.1] * 10, cached=0),
               ok(0.3, 2.3, 21, [0.1] * 20, cached=50),
               ok(0.2, 0.7, 6, [0.1] * 5),  # the server reported no cached count for this one
               RequestResult(100, error="OVERLOADED"), RequestResult(100, error="OVERLOADED"),
               RequestResult(100, error="TIMEOUT")]
    m = summarize(results, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 3)
    assert m["errors"] == {"OVERLOADED": 2, "TIMEOUT": 1}
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(38 / 4)
    assert m["total_token_throughput"] == pytest.approx((300 + 38) / 4)
    assert m["ttft_ms"]["mean"] == pytest.approx(200)
    assert m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert m["tpot_ms"]["median"] == pytest.approx(100)  # (1.1-0.1)/10, (2.3-0.3)/20, 0.5/5
    assert m["itl_ms"]["p95"] == pytest.approx(100)
    assert m["e2e_ms"]["median"] == pytest.approx(1100)
    assert m["cached_tokens"] == 50
    assert m["cached_token_ratio"] == pytest.approx(50 / 200)  # over requests that reported it
    assert m["goodput"] is None and m["slo_attainment"] is None


def test_nothing_reported_gives_none_not_zero():
    m = summarize([RequestResult(10, error="UNAVAILABLE")], duration_s=1.0)
    assert m["ttft_ms"] == {"mean": None, "median": None, "p95": None, "p99": None}
    assert m["cached_token_ratio"] is None and m["output_throughput"] == 0


def test_goodput_counts_only_successful_requests_meeting_every_slo():
    slos = parse_slos(["ttft_ms=500", "tpot_ms=100"])
    assert slos == {"ttft_ms": 500.0, "tpot_ms": 100.0}
    fast = ok(0.2, 1.2, 11)  # TTFT 200 ms, TPOT 100 ms: meets both (limits are inclusive)
    slow_first = ok(0.6, 1.6, 11)  # TTFT 600 ms
    slow_decode = ok(0.2, 2.2, 11)  # TPOT 200 ms
    one_token = ok(0.3, 0.3, 1)  # no TPOT: only TTFT applies
    failed = RequestResult(100, error="OVERLOADED")
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, one_token, failed)] == [
        True, False, False, True, False]
    m = summarize([fast, slow_first, slow_decode, one_token, failed], 2.0, slos)
    assert m["goodput"] == pytest.approx(2 / 2.0)
    assert m["slo_attainment"] == pytest.approx(2 / 5)
    assert meets_slos(ok(0.1, 1.0, 4, [0.1, 0.7, 0.1]), parse_slos(["itl_ms=500"])) is False


@pytest.mark.parametrize("bad", ["ttft=500", "ttft_ms", "queue_ms=3", "tpot_ms=0"])
def test_unknown_or_malformed_slos_are_refused(bad):
    with pytest.raises(ValueError):
        parse_slos([bad])


def test_poisson_arrivals_are_seeded_and_have_the_requested_mean_gap():
    a = arrival_times(20_000, 4.0, seed=7)
    assert a == arrival_times(20_000, 4.0, seed=7)
    assert a != arrival_times(20_000, 4.0, seed=8)
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert a[0] == 0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    assert arrival_times(5, None, 0) == arrival_times(5, float("inf"), 0) == [0.0] * 5


class SleepyBackend:
    """Answers every request after `delay_s`, counting how many are in flight at once."""

    label = "sleepy"

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.in_flight, self.peak, self.sent_at = delay_s, 0, 0, []

    async def send(self, prompt: BenchPrompt, ignore_eos: bool) -> RequestResult:
        self.sent_at.append(time.perf_counter())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return ok(self.delay_s / 2, self.delay_s, prompt.output_len)


PROMPTS = [BenchPrompt("x", 1, 4)] * 12


def test_a_fixed_concurrency_keeps_exactly_that_many_requests_in_flight():
    backend = SleepyBackend(0.05)
    run = asyncio.run(run_level(backend, PROMPTS, Level(concurrency=3), ignore_eos=True,
                                max_duration_s=60, request_timeout_s=10))
    assert backend.peak == 3 and len(run.results) == 12 and run.not_sent == 0
    assert run.duration_s == pytest.approx(4 * 0.05, abs=0.15)


def test_the_wall_clock_budget_stops_sending_and_a_slow_request_times_out():
    run = asyncio.run(run_level(SleepyBackend(0.2), PROMPTS, Level(concurrency=2),
                                ignore_eos=True, max_duration_s=0.3, request_timeout_s=10))
    assert len(run.results) == 4 and run.not_sent == 8
    run = asyncio.run(run_level(SleepyBackend(0.5), PROMPTS[:2], Level(concurrency=2),
                                ignore_eos=True, max_duration_s=10, request_timeout_s=0.1))
    assert [r.error for r in run.results] == ["TIMEOUT", "TIMEOUT"]


def test_a_request_rate_offers_requests_at_their_arrival_times():
    backend = SleepyBackend(0.01)
    asyncio.run(run_level(backend, PROMPTS[:6], Level(request_rate=20.0), ignore_eos=True,
                          max_duration_s=60, request_timeout_s=10, seed=5))
    offsets = [t - backend.sent_at[0] for t in backend.sent_at]
    assert offsets == pytest.approx(arrival_times(6, 20.0, seed=5), abs=0.05)


def test_every_bench_serve_option_says_what_it_does():
    from ops.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in sub.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    options = [a for a in bench.choices["serve"]._actions if a.option_strings and a.dest != "help"]
    assert [a.option_strings[0] for a in options if not a.help] == []


def test_kv_capacity_plot_reads_bench_kv_formats_json(tmp_path):
    from ops.bench.plot_kv_capacity import main, out_of_pages

    def point(tok_s: float, peak: int, preemptions: int) -> dict:
        return {"tok_s": tok_s, "peak_running": peak, "preemptions": preemptions}

    rows = [{"concurrency": c, "requests": c, "bf16": point(b, min(c, 38), p),
             "fp8": point(f, c, 0)}
            for c, b, p, f in ((1, 25, 0, 27), (8, 80, 0, 85), (32, 155, 13, 168),
                               (64, 152, 50, 202))]
    report = {"date": "2026-11-30", "threads": 2, "kv_cache_bytes": 64 << 20, "repeats": 1,
              "capacity_tokens": {"bf16": 2912, "fp8": 5648}, "rows": rows}
    src = tmp_path / "kv_formats.json"
    src.write_text(json.dumps(report))
    assert main([str(src)]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "kv_formats.png").exists()
    assert [out_of_pages(r["bf16"], r["concurrency"]) for r in rows] == [False, False, True, True]


# --- one short real run: a real gateway with one worker, gRPC and the REST shim ------------


@pytest.fixture(scope="module")
def endpoints() -> Iterator[tuple[str, str]]:
    from gateway.rest import GatewayView, RestServer
    from gateway.runner import GatewayRunner
    from tests.gateway.conftest import api_keys, pool_config

    runner = GatewayRunner([pool_config(min_workers=1, max_workers=1)], api_keys()).start()
    assert runner.gateway is not None
    server = RestServer(runner.target, port=0, view=GatewayView(runner.gateway, runner.loop),
                        operator_key="operator-key-for-tests")
    runner.call(server.start())
    yield runner.target, f"{server.url}/v1"
    runner.call(server.stop())
    runner.stop()


@pytest.fixture(scope="module")
def runs(endpoints, tmp_path_factory) -> dict[str, Path]:
    from ops.cli import main
    from tests.gateway.conftest import KEYS

    target, base_url = endpoints
    out = tmp_path_factory.mktemp("bench")
    common = ["bench", "serve", "--api-key", KEYS["acme"], "--concurrency", "2",
              "--num-prompts", "4", "--output-len", "8", "--slo", "ttft_ms=60000",
              "--slo", "tpot_ms=60000"]
    # gRPC with one shared 64-token prefix (4 pages): later requests hit the prefix cache.
    assert main([*common, "--backend", "grpc", "--target", f"tessera-grpc={target}",
                 "--prefix-len", "64", "--input-len", "16", "--out", str(out / "grpc.json")]) == 0
    assert main([*common, "--backend", "openai", "--base-url", f"shim={base_url}",
                 "--input-len", "32", "--seed", "1", "--out", str(out / "openai.json")]) == 0
    return {"grpc": out / "grpc.json", "openai": out / "openai.json"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_a_real_run_writes_one_record_with_sane_metrics(runs, backend):
    report = json.loads(runs[backend].read_text())
    assert report["machine"]["cores"] >= 1 and "api_key" not in report["config"]
    [record] = report["records"]
    assert record["level"] == {"kind": "concurrency", "value": 2, "concurrency": 2,
                               "request_rate": None}
    assert record["endpoint"]["backend"] == backend
    m = record["metrics"]
    assert (m["completed"], m["failed"], m["errors"]) == (4, 0, {})
    assert m["total_output_tokens"] == 4 * 8  # ignore_eos: every request runs to max_tokens
    assert m["total_input_tokens"] >= 4 * 32 - 8
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    assert 0 < m["ttft_ms"]["median"] <= m["e2e_ms"]["median"] <= m["duration_s"] * 1000
    assert 0 < m["tpot_ms"]["median"] and 0 < m["itl_ms"]["median"]
    assert m["goodput"] == pytest.approx(m["request_throughput"])  # loose SLOs: all meet them
    assert m["cached_token_ratio"] is not None  # tessera reports cached tokens on both paths
    if backend == "grpc":
        assert m["cached_token_ratio"] > 0
    assert runs[backend].with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_compare_prints_both_runs_and_writes_a_png(runs, tmp_path, capsys):
    from ops.cli import main

    png = tmp_path / "cmp.png"
    assert main(["bench", "serve", "--compare", str(runs["grpc"]), str(runs["openai"]),
                 "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "grpc:tessera-grpc" in table and "openai:shim" in table and "c=2" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
