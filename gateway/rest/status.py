"""What the status page shows: the shim's own counts (requests per route and reason, tokens),
and, when the shim runs in the gateway's process, a read-only view of pools and workers."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from gateway import metrics
from gateway._proto.tessera.v1 import worker_pb2 as wpb

if TYPE_CHECKING:
    from gateway.client import Usage
    from gateway.grpc_server import Gateway
    from gateway.supervisor import WorkerPool
    from gateway.worker_handle import WorkerHandle


_ROUTES = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
           ("/v1/models", "models"), ("/ai/run/", "ai.run"))


def route_of(path: str) -> str:
    """The route name requests are counted under (a fixed set: never the path itself)."""
    for prefix, name in _ROUTES:
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return name
    return "other"


class ShimStats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.tokens: Counter[str] = Counter()

    def record(self, route: str, reason: str, usage: Usage | None) -> None:
        self.requests[(route, reason)] += 1
        if usage is not None:
            self.tokens["prompt"] += usage.prompt_tokens
            self.tokens["cached"] += usage.cached_tokens
            self.tokens["completion"] += usage.completion_tokens

    def snapshot(self) -> dict[str, Any]:
        by_reason: Counter[str] = Counter()
        for (_, reason), n in self.requests.items():
            by_reason[reason] += n
        return {"uptime_s": round(time.monotonic() - self.started, 1),
                "requests_by_reason": dict(sorted(by_reason.items())),
                "requests_by_route": {f"{r} {why}": n for (r, why), n in
                                      sorted(self.requests.items())},
                "tokens": token_totals(self.tokens)}


def token_totals(tokens: Counter[str] | dict[str, int]) -> dict[str, Any]:
    prompt, cached = tokens.get("prompt", 0), tokens.get("cached", 0)
    return {"prompt": prompt, "cached": cached, "completion": tokens.get("completion", 0),
            "cached_ratio": round(cached / prompt, 4) if prompt else 0.0}


class GatewayView:
    """Reads the in-process gateway on its own event loop (whichever loop the shim runs on)."""

    def __init__(self, gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.gateway, self.loop = gateway, loop

    async def snapshot(self) -> dict[str, Any]:
        if asyncio.get_running_loop() is self.loop:
            return await self._collect()
        future = asyncio.run_coroutine_threadsafe(self._collect(), self.loop)
        return await asyncio.wrap_future(future)

    async def _collect(self) -> dict[str, Any]:
        pools = [await _pool(model, pool) for model, pool in list(self.gateway.pools.items())]
        tokens: Counter[str] = Counter()
        for totals in list(self.gateway.usage.values()):  # NOTE: summed: no tenant names shown
            for kind, n in totals.items():
                tokens[kind.removesuffix("_tokens")] += n
        return {"pools": pools, "tokens": token_totals(tokens),
                "requests_by_reason": _requests_by_reason()}


async def _pool(model: str, pool: WorkerPool) -> dict[str, Any]:
    workers = list(pool.workers.values())
    statuses = await asyncio.gather(*(_worker_status(w) for w in workers))
    return {"model": model, "waiting": pool.waiting,
            "min_workers": pool.config.min_workers, "max_workers": pool.config.max_workers,
            "spawned": pool.stats.spawned, "crashed": pool.stats.crashed,
            "reaped": pool.stats.reaped, "recycled": pool.stats.recycled,
            "start_failures": pool.start_failures.consecutive,
            "start_failed": pool.start_failures.failed and not pool.ready(),
            "start_error": pool.start_failures.cause,
            "workers": [_worker(w, s) for w, s in zip(workers, statuses, strict=True)]}


async def _worker_status(worker: WorkerHandle) -> wpb.StatusResponse | None:
    if worker.state not in ("ready", "draining") or worker.stub is None:
        return None
    try:
        return await worker.stub.Status(wpb.StatusRequest(), timeout=2)
    except Exception:  # a worker going away mid-read is shown as having no numbers
        return None


def _worker(worker: WorkerHandle, s: wpb.StatusResponse | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": worker.id, "state": worker.state, "pid": worker.pid,
                           "inflight": worker.inflight,
                           "requests_served": worker.requests_served}
    if s is None:
        return out
    served = s.served
    out.update(
        pages_total=s.num_pages, pages_free=s.num_free_pages,
        # NOTE: as /metrics counts them: used + free + cached = total (cached pages are held
        # by the prefix cache alone, reclaimable; used ones by requests)
        pages_used=max(0, s.num_pages - s.num_free_pages - s.prefix_cache.cached_pages),
        pages_cached=s.prefix_cache.cached_pages,
        page_size=s.page_size, running=s.num_running, waiting=s.num_waiting,
        preemptions=s.num_preemptions, integrity_checks=s.integrity_checks,
        integrity_mismatches=s.integrity_mismatches,
        served={"revision": served.revision,
                "prefill": f"{served.prefill.weights}/{served.prefill.kv_cache}",
                "decode": f"{served.decode.weights}/{served.decode.kv_cache}"})
    return out


def _requests_by_reason() -> dict[str, int]:
    """The gateway's own request counter (Prometheus, this process), summed over models."""
    out: Counter[str] = Counter()
    for family in metrics.REQUESTS.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["reason"]] += int(sample.value)
    return dict(sorted(out.items()))
