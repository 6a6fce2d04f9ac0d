"""The decode side's wait for KV pages (gateway/transfer.py): a request whose pages are not free
waits for them, first come first served, holding nothing, until its deadline.

Users of vLLM's and SGLang's prefill/decode pools expect a full decode side to queue a
transfer rather than refuse it; the prefill side is not called until the pages are reserved.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from gateway.errors import DeadlineExceeded
from runtime.async_engine import AsyncLLM
from runtime.disagg.importer import KVImport
from runtime.errors import KVPoolExhausted

RESERVE_POLL_S = 0.02  # how often a request waiting for pages looks at the engine's snapshot


class PageWait:
    """The reservations of one decode worker, oldest first."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self._waiting: deque[object] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for free pages now (the decode side's queue depth)."""
        return len(self._waiting)

    async def reserve(self, make: Callable[[], KVImport], timeout_s: float,
                      time_left_s: float | None) -> KVImport:
        """The reservation, first come first served: while the pool lacks the pages, wait
        until the caller's deadline (then DEADLINE_EXCEEDED), or for a caller without one
        `timeout_s` (then OVERLOADED, retryable). Only the oldest waiter tries, and only once
        the engine's last snapshot shows room, so a large prompt is not starved by smaller
        ones behind it."""
        started = time.monotonic()
        bound_s = timeout_s if time_left_s is None else time_left_s
        ticket = object()
        self._waiting.append(ticket)
        needed = 0
        refused = KVPoolExhausted("no KV pages free for this request's import")
        try:
            while True:
                if self._waiting[0] is ticket and self._room() >= needed:
                    try:
                        return await self._reserve_now(make)
                    except KVPoolExhausted as e:
                        needed = int(e.metadata.get("needed_pages", 1))
                        refused = e
                if time.monotonic() - started >= bound_s:
                    if time_left_s is not None:
                        raise DeadlineExceeded("the deadline passed while this request waited "
                                               "for free KV pages on the decode side")
                    refused.metadata["retry_after_s"] = "1"
                    raise refused
                await asyncio.sleep(RESERVE_POLL_S)
        finally:
            self._waiting.remove(ticket)

    def _room(self) -> int:
        """Pages a reservation could take now, as of the engine's last published pass."""
        stats = self.llm.snapshot.stats
        return stats.num_free_pages + stats.num_evictable_pages

    async def _reserve_now(self, make: Callable[[], KVImport]) -> KVImport:
        """The reservation, made on the engine thread. NOTE: a caller cancelled while it is
        being made must not leak it: the call runs on, shielded, and what it took is freed."""
        fut = asyncio.ensure_future(self.llm.call(make))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def free(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.llm.submit(f.result().abort)
            fut.add_done_callback(free)
            raise
