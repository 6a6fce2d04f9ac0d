"""Fairness between tenants in a pool's wait queue. Each tenant may hold at most `max_inflight`
worker slots and have at most `max_queued` requests waiting (per model; from its API key, else
the serve defaults). When a slot frees, the waiting tenant with the fewest requests in flight
goes next, ties to the one served least recently (round robin); a tenant's own requests keep
their order. Plain Python over counters and deques, no I/O."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass

from gateway.errors import TenantConcurrencyExceeded
from runtime.errors import InvalidArgument

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class TenantLimits:
    """None: no limit of that kind (in a key's own limits: the serve default applies)."""

    max_inflight: int | None = None  # requests holding a worker slot at once
    max_queued: int | None = None  # requests waiting for a slot

    def __post_init__(self) -> None:
        if self.max_inflight is not None and self.max_inflight < 1:
            raise InvalidArgument("max_inflight must be >= 1", field="max_inflight")
        if self.max_queued is not None and self.max_queued < 0:
            raise InvalidArgument("max_queued must be >= 0", field="max_queued")

    def over(self, defaults: TenantLimits) -> TenantLimits:
        """These limits, each unset one taken from `defaults`."""
        return TenantLimits(
            defaults.max_inflight if self.max_inflight is None else self.max_inflight,
            defaults.max_queued if self.max_queued is None else self.max_queued)


NO_LIMITS = TenantLimits()


class Ticket:
    """One request of a tenant, from its arrival until it takes a slot or gives up."""

    __slots__ = ("limits", "tenant")

    def __init__(self, tenant: str, limits: TenantLimits) -> None:
        self.tenant, self.limits = tenant, limits

    def __repr__(self) -> str:
        return f"Ticket({self.tenant!r})"


class FairQueue:
    def __init__(self) -> None:
        self._waiting: dict[str, deque[Ticket]] = {}
        self.inflight: Counter[str] = Counter()
        self._last_served: dict[str, int] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return sum(len(tickets) for tickets in self._waiting.values())

    def queued(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def join(self, tenant: str, limits: TenantLimits = NO_LIMITS) -> Ticket:
        """A request arrives; it may start at once if next_up() says it is its turn."""
        ticket = Ticket(tenant, limits)
        self._waiting.setdefault(tenant, deque()).append(ticket)
        return ticket

    def must_wait(self, ticket: Ticket, model: str = "") -> None:
        """The request cannot start now, so it waits: unless its tenant already has
        `max_queued` others waiting, which refuses it (retryable)."""
        limits = ticket.limits
        others = self.queued(ticket.tenant) - 1
        if limits.max_queued is None or others < limits.max_queued:
            return
        caps = {k: v for k, v in (("max_inflight", limits.max_inflight),
                                  ("max_queued", limits.max_queued)) if v is not None}
        raise TenantConcurrencyExceeded(
            f"this key already has {self.inflight[ticket.tenant]} requests in flight and "
            f"{others} waiting for model {model!r}, its limit; retry when one ends",
            retry_after_s=RETRY_AFTER_S, model=model, **caps)

    def next_up(self) -> Ticket | None:
        """Whose turn it is when a slot is free: the oldest request of the waiting tenant with
        the fewest in flight (below its own cap), ties to the tenant served least recently."""
        best: Ticket | None = None
        best_rank: tuple[int, int] | None = None
        for tenant, tickets in self._waiting.items():
            head = tickets[0]
            cap = head.limits.max_inflight
            if cap is not None and self.inflight[tenant] >= cap:
                continue
            rank = (self.inflight[tenant], self._last_served.get(tenant, 0))
            if best_rank is None or rank < best_rank:
                best, best_rank = head, rank
        return best

    def start(self, ticket: Ticket) -> None:
        """The request took a slot."""
        self._remove(ticket)
        self.inflight[ticket.tenant] += 1
        self._last_served[ticket.tenant] = next(self._clock)

    def leave(self, ticket: Ticket) -> None:
        """The request gave up waiting (refused, timed out, cancelled)."""
        self._remove(ticket)

    def finish(self, tenant: str) -> None:
        """A request of `tenant` that held a slot ended."""
        if self.inflight[tenant] > 1:
            self.inflight[tenant] -= 1
        else:
            del self.inflight[tenant]

    def _remove(self, ticket: Ticket) -> None:
        tickets = self._waiting[ticket.tenant]
        tickets.remove(ticket)
        if not tickets:
            del self._waiting[ticket.tenant]
