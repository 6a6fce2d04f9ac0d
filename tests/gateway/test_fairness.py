"""Fairness between tenants: the FairQueue's order and limits (plain Python), then a pool's
admission on stand-in workers (no processes): one tenant's flood never delays another's turn."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from gateway.errors import Overloaded, TenantConcurrencyExceeded, retry_delay_s
from gateway.fairness import FairQueue, TenantLimits
from gateway.supervisor import PoolConfig, WorkerPool
from runtime.errors import InvalidArgument
from tests.gateway.test_pool_rules import StandIn

MODEL = "fair-m"


def turns(queue: FairQueue, n: int) -> list[str]:
    """The tenants that take n slots, one after another, each slot freed again at once."""
    taken = []
    for _ in range(n):
        ticket = queue.next_up()
        assert ticket is not None
        queue.start(ticket)
        queue.finish(ticket.tenant)
        taken.append(ticket.tenant)
    return taken


def test_freed_slot_goes_to_the_waiting_tenant_with_fewest_in_flight() -> None:
    q = FairQueue()
    for _ in range(3):
        q.start(q.join("alpha"))
    flood = [q.join("alpha") for _ in range(5)]
    beta = q.join("beta")
    assert q.next_up() is beta
    q.start(beta)
    assert q.next_up() is flood[0], "then alpha's oldest request"


def test_tenants_tied_on_in_flight_take_turns() -> None:
    q = FairQueue()
    for tenant in ("alpha",) * 4 + ("beta",) * 2 + ("gamma",) * 2:
        q.join(tenant)
    assert turns(q, 8) == ["alpha", "beta", "gamma", "alpha", "beta", "gamma", "alpha", "alpha"]
    assert len(q) == 0 and not q.inflight


def test_a_tenants_own_requests_keep_their_order() -> None:
    q = FairQueue()
    first, second = q.join("alpha"), q.join("alpha")
    assert q.next_up() is first
    q.leave(first)
    assert q.next_up() is second


def test_tenant_at_its_inflight_cap_waits_while_others_go() -> None:
    q = FairQueue()
    capped = TenantLimits(max_inflight=1)
    q.start(q.join("alpha", capped))
    waiting = q.join("alpha", capped)
    assert q.next_up() is None, "alpha is at its cap and nobody else waits"
    beta = q.join("beta")
    assert q.next_up() is beta
    q.start(beta)
    q.finish("alpha")
    assert q.next_up() is waiting


def test_tenant_past_its_queue_bound_is_refused_with_a_retry_hint() -> None:
    q = FairQueue()
    limits = TenantLimits(max_inflight=2, max_queued=1)
    q.must_wait(q.join("alpha", limits), MODEL)
    with pytest.raises(TenantConcurrencyExceeded) as info:
        q.must_wait(q.join("alpha", limits), MODEL)
    err = info.value
    assert err.reason == "TENANT_CONCURRENCY_EXCEEDED" and retry_delay_s(err) == 1.0
    assert err.metadata == {"retry_after_s": "1", "model": MODEL, "max_inflight": "2",
                            "max_queued": "1"}
    q.must_wait(q.join("beta", limits), MODEL)  # another tenant's bound is its own


def test_key_limits_fall_back_to_the_serve_defaults_one_by_one() -> None:
    defaults = TenantLimits(max_inflight=8, max_queued=32)
    assert TenantLimits(max_queued=0).over(defaults) == TenantLimits(8, 0)
    assert TenantLimits().over(defaults) == defaults
    with pytest.raises(InvalidArgument):
        TenantLimits(max_inflight=0)


# -- a pool's admission, on stand-in workers ----------------------------------------------------

def one_slot_pool(slots: int = 1, **config: object) -> WorkerPool:
    config = {"min_workers": 1, "max_workers": 1, **config}
    pool = WorkerPool(PoolConfig(MODEL, **config), run_dir="unused")  # type: ignore[arg-type]
    worker = StandIn("w0", 0.0)
    worker.max_inflight = slots
    pool.workers = {worker.id: worker}  # type: ignore[dict-item]
    return pool


async def queued(pool: WorkerPool, n: int) -> None:
    while len(pool.queue) < n:
        await asyncio.sleep(0)


def test_one_tenants_flood_does_not_delay_anothers_request() -> None:
    async def scenario() -> None:
        pool = one_slot_pool(max_queue=64)
        held = await pool.acquire(timeout_s=5, tenant="alpha")
        flood = [asyncio.create_task(pool.acquire(timeout_s=5, tenant="alpha"))
                 for _ in range(5)]
        await queued(pool, 5)
        beta = asyncio.create_task(pool.acquire(timeout_s=5, tenant="beta"))
        await queued(pool, 6)
        await pool.release(held, "alpha")
        done, _ = await asyncio.wait([beta, *flood], timeout=2,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done == {beta}, "the slot went to beta, not to alpha's older requests"
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert len(pool.queue) == 0 and pool.waiting == 0

    asyncio.run(scenario())


def test_tenant_at_its_cap_waits_though_a_slot_is_free_and_starts_no_worker() -> None:
    async def scenario() -> None:
        pool = one_slot_pool(slots=2, max_workers=2)
        spawned: list[int] = []
        pool._spawn = lambda: spawned.append(1)  # type: ignore[assignment,method-assign]
        capped = TenantLimits(max_inflight=1)
        first = await pool.acquire(timeout_s=5, tenant="alpha", limits=capped)
        second = asyncio.create_task(pool.acquire(timeout_s=5, tenant="alpha", limits=capped))
        await queued(pool, 1)
        assert not spawned, "a free slot is there; only alpha's own cap holds it back"
        await pool.acquire(timeout_s=1, tenant="beta")  # takes the free slot at once
        assert not second.done()
        await pool.release(first, "alpha")
        await asyncio.wait_for(second, 1)

    asyncio.run(scenario())


def test_tenant_bound_refuses_before_the_pools_and_counts_the_refusal() -> None:
    async def scenario() -> None:
        pool = one_slot_pool(max_queue=2)
        limits = TenantLimits(max_queued=1)
        await pool.acquire(timeout_s=5, tenant="alpha", limits=limits)
        waiter = asyncio.create_task(pool.acquire(timeout_s=5, tenant="alpha", limits=limits))
        await queued(pool, 1)
        with pytest.raises(TenantConcurrencyExceeded):
            await pool.acquire(timeout_s=5, tenant="alpha", limits=limits)
        other = asyncio.create_task(pool.acquire(timeout_s=5, tenant="beta"))
        await queued(pool, 2)
        with pytest.raises(Overloaded):  # the pool's own bound, for a tenant under its own
            await pool.acquire(timeout_s=5, tenant="gamma")
        assert sample("tessera_gateway_tenant_queued", tenant="alpha") == 1
        assert sample("tessera_gateway_tenant_inflight", tenant="alpha") == 1
        for task in (waiter, other):
            task.cancel()
        await asyncio.gather(waiter, other, return_exceptions=True)
        assert sample("tessera_gateway_tenant_queued", tenant="alpha") == 0

    before = sample("tessera_gateway_tenant_refused_total", tenant="alpha",
                    reason="TENANT_CONCURRENCY_EXCEEDED")
    asyncio.run(scenario())
    assert sample("tessera_gateway_tenant_refused_total", tenant="alpha",
                  reason="TENANT_CONCURRENCY_EXCEEDED") == before + 1
    assert sample("tessera_gateway_tenant_refused_total", tenant="gamma", reason="OVERLOADED") >= 1


def test_a_waiter_that_gives_up_passes_its_turn_at_once() -> None:
    async def scenario() -> None:
        pool = one_slot_pool()
        held = await pool.acquire(timeout_s=5, tenant="x")
        alpha = asyncio.create_task(pool.acquire(timeout_s=5, tenant="alpha"))
        await queued(pool, 1)
        beta = asyncio.create_task(pool.acquire(timeout_s=5, tenant="beta"))
        await queued(pool, 2)
        await pool.release(held, "x")
        alpha.cancel()
        # NOTE: well under the 1 s a waiter sleeps between checks when nobody wakes it.
        lease = await asyncio.wait_for(beta, 0.3)
        assert lease is not None and alpha.cancelled()
        await pool.release(lease, "beta")

    asyncio.run(scenario())


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, **labels}) or 0.0
