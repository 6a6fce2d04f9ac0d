"""A pool's admission: requests wait for a worker slot in a bounded queue, fair between tenants
(gateway/fairness.py). Past a tenant's own bound, TENANT_CONCURRENCY_EXCEEDED; past the pool's,
OVERLOADED; both with a retry hint. Where the slots come from (the pool's workers, started on
demand) is the pool's business (gateway/supervisor.py), seen here through `Slots`."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from gateway import metrics
from gateway.errors import DeadlineExceeded, Overloaded, TenantConcurrencyExceeded, WorkerLost
from gateway.fairness import NO_LIMITS, FairQueue, TenantLimits, Ticket


class Slots(Protocol):
    """What admission asks of a pool."""

    @property
    def closed(self) -> bool: ...

    @property
    def max_queue(self) -> int:
        """Requests that may wait, all tenants (read at each admission: it may change)."""

    def check_startable(self) -> None:
        """Raise (WORKER_START_FAILED) when no worker can serve nor start."""

    def take_slot(self, session: str | None, prefix_key: str | None) -> Any | None:
        """A worker with a free slot, its slot taken, or None."""

    def wake(self) -> None:
        """No worker has a free slot: start one if the pool may."""


class Admission:
    """The wait queue of one pool (`model`: its label in metrics)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.queue = FairQueue()
        self.waiting = 0  # requests that could not start at once, all tenants
        self.changed = asyncio.Condition()

    async def admit(self, slots: Slots, session: str | None, prefix_key: str | None,
                    timeout_s: float | None, default_wait_s: float, tenant: str,
                    limits: TenantLimits = NO_LIMITS) -> Any:
        """A slot of `slots` for one request of `tenant`: taken at once when it is this
        ticket's turn and a worker has room, else after waiting (woken by notify()) until
        `timeout_s` (DEADLINE_EXCEEDED) or `default_wait_s` when None (OVERLOADED)."""
        wait_s = default_wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        async with self.changed:
            ticket = self.queue.join(tenant, limits)
            started = queued = False
            try:
                while True:
                    slots.check_startable()
                    if self.queue.next_up() is ticket:
                        worker = slots.take_slot(session, prefix_key)
                        if worker is not None:
                            self.queue.start(ticket)
                            started = True
                            # NOTE: another slot may be free for whoever's turn is next.
                            self.changed.notify_all()
                            return worker
                    slots.wake()
                    if not queued:
                        self._check_room(ticket, slots.max_queue)
                        queued = True
                        self._set_waiting(+1, tenant)
                    left = deadline - time.monotonic()
                    if left <= 0 and timeout_s is not None:
                        raise DeadlineExceeded("deadline passed while waiting for a worker")
                    if left <= 0:
                        raise Overloaded(f"no worker of {self.model!r} became free in "
                                         f"{wait_s:.0f} s", retry_after_s=1)
                    await wait_for_change(self.changed, min(left, 1.0))
                    if slots.closed:
                        raise WorkerLost("the gateway is shutting down")
            finally:
                if not started:
                    self.queue.leave(ticket)
                    self.changed.notify_all()  # the turn may pass to another tenant
                if queued:
                    self._set_waiting(-1, tenant)
                self.tenant_gauges(tenant)

    def finish(self, tenant: str) -> None:
        """A request of `tenant` admitted earlier has ended (its slot is the pool's again)."""
        self.queue.finish(tenant)
        self.tenant_gauges(tenant)

    async def notify(self) -> None:
        """Wake every waiting request: a slot may have freed, a worker become ready."""
        async with self.changed:
            self.changed.notify_all()

    def _set_waiting(self, change: int, tenant: str) -> None:
        self.waiting += change
        metrics.QUEUE_DEPTH.labels(self.model).set(self.waiting)
        if change > 0:
            self.tenant_gauges(tenant)

    def _check_room(self, ticket: Ticket, max_queue: int) -> None:
        """A request that must wait: refused past its tenant's queue bound, then the pool's."""
        try:
            self.queue.must_wait(ticket, self.model)
        except TenantConcurrencyExceeded as e:
            metrics.TENANT_REFUSED.labels(self.model, ticket.tenant, e.reason).inc()
            raise
        if self.waiting >= max_queue:
            metrics.REJECTED.labels(self.model).inc()
            metrics.TENANT_REFUSED.labels(self.model, ticket.tenant, Overloaded.reason).inc()
            raise Overloaded(f"model {self.model!r} is at capacity; retry shortly",
                             retry_after_s=1, model=self.model)

    def tenant_gauges(self, tenant: str) -> None:
        metrics.TENANT_INFLIGHT.labels(self.model, tenant).set(self.queue.inflight[tenant])
        metrics.TENANT_QUEUED.labels(self.model, tenant).set(self.queue.queued(tenant))


async def wait_for_change(changed: asyncio.Condition, timeout_s: float) -> None:
    """Until notified or timeout_s passed; the lock is held again on return, and the
    caller's cancellation is never lost (asyncio.wait_for can swallow it before 3.12,
    and a cancelled request would then take a slot for nobody)."""
    waiting = asyncio.ensure_future(changed.wait())
    cancelled = False
    try:
        await asyncio.wait({waiting}, timeout=timeout_s)
    except asyncio.CancelledError:
        cancelled = True
    waiting.cancel()
    # NOTE: the lock is ours again only once that wait has re-acquired it.
    while not waiting.done():
        try:
            await asyncio.wait({waiting})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
