"""Per-request timings and what one benchmark level reports from them: throughput, TTFT, TPOT,
ITL, end-to-end latency, cached-token ratio, errors by reason and goodput under SLOs.

Definitions (those of `vllm bench serve`): TTFT is send -> first token; TPOT of a request is
(e2e - ttft) / (output_tokens - 1), for requests with at least two output tokens; ITL is every
gap between consecutive streamed chunks; goodput is the successful requests meeting every SLO
per second of the level's wall time. Plain Python, no numpy: tested on synthetic timings.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# SLO names: what each limits, in milliseconds.
SLO_NAMES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from when it was sent."""

    prompt_tokens: int  # as reported by the server's usage, else as counted by the client
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)  # inter-chunk latencies (ITL)
    cached_tokens: int | None = None  # None: the server did not report it
    error: str | None = None  # UPPER_SNAKE reason; None when the request succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default `percentile`)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Iterable[float | None]) -> dict[str, float | None]:
    """mean, median, p95 and p99 in milliseconds; None everywhere when there is no value."""
    xs = [v * 1000 for v in values_s if v is not None]
    if not xs:
        return {"mean": None, "median": None, "p95": None, "p99": None}
    return {"mean": sum(xs) / len(xs), "median": percentile(xs, 50),
            "p95": percentile(xs, 95), "p99": percentile(xs, 99)}


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """`["ttft_ms=500", "tpot_ms=100"]` -> {"ttft_ms": 500.0, "tpot_ms": 100.0}."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--slo takes NAME=MS with NAME one of {', '.join(SLO_NAMES)}; "
                             f"got {item!r}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"--slo {name} must be positive")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A failed request meets none; a limit on a value the request lacks (TPOT of a one-token
    output, ITL of a one-chunk stream) is met."""
    if not r.ok:
        return False
    values_ms = {"ttft_ms": [r.ttft_s], "tpot_ms": [r.tpot_s], "itl_ms": r.chunk_gaps_s,
                 "e2e_ms": [r.e2e_s]}
    return all(v * 1000 <= limit for name, limit in slos.items()
               for v in values_ms[name] if v is not None)


def summarize(results: Sequence[RequestResult], duration_s: float,
              slos: dict[str, float] | None = None) -> dict:
    """The metrics of one level: `duration_s` is its wall time, first send to last reply."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    reported_prompt = sum(r.prompt_tokens for r in reported)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    metrics = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": distribution_ms(r.ttft_s for r in ok),
        "tpot_ms": distribution_ms(r.tpot_s for r in ok),
        "itl_ms": distribution_ms(g for r in ok for g in r.chunk_gaps_s),
        "e2e_ms": distribution_ms(r.e2e_s for r in ok),
        "cached_tokens": cached if reported else None,
        "cached_token_ratio": cached / reported_prompt if reported_prompt else None,
        "slos": dict(slos or {}),
        "goodput": None, "slo_attainment": None,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        metrics["goodput"] = per_s(good)
        metrics["slo_attainment"] = good / len(results) if results else None
    return metrics
