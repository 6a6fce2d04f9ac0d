"""Pool rules on stand-in workers (no processes): idle reap down to the minimum, recycle by
age, drain before retiring, restart backoff that doubles per consecutive crash, bounded queue."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import Overloaded
from gateway.supervisor import PoolConfig, WorkerPool


class StandIn:
    def __init__(self, worker_id: str, now: float) -> None:
        self.id, self.state, self.inflight = worker_id, "ready", 0
        self.max_inflight, self.requests_served = 1, 0
        self.last_used = self.ready_at = now
        self.terminated = False

    @property
    def available(self) -> bool:
        return self.state == "ready" and self.inflight < self.max_inflight

    async def terminate(self) -> None:
        self.terminated = True


def pool_with(n: int, now: float = 100.0, **config: object) -> tuple[WorkerPool, list[StandIn]]:
    pool = WorkerPool(PoolConfig("m", **config), run_dir="unused")  # type: ignore[arg-type]
    workers = [StandIn(f"w{i}", now) for i in range(n)]
    pool.workers = {w.id: w for w in workers}  # type: ignore[misc]
    return pool, workers


def test_idle_workers_are_reaped_down_to_the_minimum() -> None:
    pool, workers = pool_with(3, min_workers=1, max_workers=3, idle_ttl_s=10)
    asyncio.run(pool.tick(now=105.0))
    assert not any(w.terminated for w in workers)
    asyncio.run(pool.tick(now=111.0))
    assert sum(w.terminated for w in workers) == 2 and pool.stats.reaped == 2


def test_busy_worker_is_not_reaped() -> None:
    pool, [w] = pool_with(1, min_workers=0, idle_ttl_s=1)
    w.inflight = 1
    asyncio.run(pool.tick(now=500.0))
    assert w.state == "ready" and not w.terminated


def test_old_worker_drains_then_retires() -> None:
    pool, [w] = pool_with(1, min_workers=0, recycle_after_s=60)
    w.inflight = 1
    asyncio.run(pool.tick(now=200.0))
    assert w.state == "draining" and not w.terminated and not w.available

    async def finish() -> None:
        await pool.release(w)  # type: ignore[arg-type]
        await asyncio.sleep(0)

    asyncio.run(finish())
    assert w.terminated and pool.stats.recycled == 1


def test_restart_backoff_doubles_per_consecutive_crash_up_to_the_cap(monkeypatch) -> None:
    import gateway.supervisor as supervisor

    monkeypatch.setattr(supervisor.time, "monotonic", lambda: 1000.0)
    pool, workers = pool_with(4, restart_backoff_s=0.5, max_restart_backoff_s=1.5)
    backoffs = []
    for w in workers:
        pool._on_crash(w, -9)  # type: ignore[arg-type]
        backoffs.append(pool._next_spawn_at - 1000.0)
    assert backoffs == [0.5, 1.0, 1.5, 1.5] and pool.stats.crashed == 4


def test_full_queue_is_refused_with_a_retry_hint() -> None:
    pool, [w] = pool_with(1, min_workers=1, max_workers=1, max_queue=0)
    w.inflight = 1
    with pytest.raises(Overloaded) as info:
        asyncio.run(pool.acquire(timeout_s=1))
    assert info.value.metadata["retry_after_s"] == "1"
