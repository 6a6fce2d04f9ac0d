"""How one benchmark level offers load: a fixed number of requests in flight (a closed loop), or
Poisson arrivals at a request rate (an open loop, optionally capped in flight); bounded by the
number of prompts and a wall-clock budget."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ops.bench.serving.backends import Backend
from ops.bench.serving.metrics import RequestResult
from ops.bench.serving.prompts import BenchPrompt


@dataclass(frozen=True)
class Level:
    """`concurrency` alone: closed loop. `request_rate` (requests/s, inf: all at once), with
    `concurrency` as an optional cap on requests in flight: open loop."""

    concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("a level needs a concurrency or a request rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("the request rate must be positive")

    @property
    def kind(self) -> str:
        return "request_rate" if self.request_rate is not None else "concurrency"

    @property
    def value(self) -> float:
        return self.request_rate if self.request_rate is not None else self.concurrency  # type: ignore[return-value]


def arrival_times(num_requests: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the level starts at which each request is offered: exponential gaps of
    mean 1/rate (a Poisson process), the first at 0; all 0 without a rate or at inf."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


@dataclass
class LevelRun:
    results: list[RequestResult]
    duration_s: float  # first send to last reply
    not_sent: int  # prompts left when the wall-clock budget ran out


async def run_level(backend: Backend, prompts: Sequence[BenchPrompt], level: Level, *,
                    ignore_eos: bool, max_duration_s: float, request_timeout_s: float,
                    seed: int = 0) -> LevelRun:
    arrivals = arrival_times(len(prompts), level.request_rate, seed)
    slots = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    start = time.perf_counter()
    deadline = start + max_duration_s

    async def send(prompt: BenchPrompt) -> RequestResult | None:
        if time.perf_counter() >= deadline:
            return None
        try:
            return await asyncio.wait_for(backend.send(prompt, ignore_eos), request_timeout_s)
        except asyncio.TimeoutError:
            return RequestResult(prompt.prompt_tokens, error="TIMEOUT")

    async def offer(prompt: BenchPrompt, at_s: float) -> RequestResult | None:
        await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
        if slots is None:
            return await send(prompt)
        async with slots:
            return await send(prompt)

    done = await asyncio.gather(*(offer(p, t) for p, t in zip(prompts, arrivals, strict=True)))
    duration = time.perf_counter() - start
    results = [r for r in done if r is not None]
    return LevelRun(results, duration, len(done) - len(results))
