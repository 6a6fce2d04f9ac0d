"""The shim's shutdown, in three steps: draining (new API requests get 503 UNAVAILABLE while
in-flight ones go on), then ended (what is still in flight is ended with UNAVAILABLE in its own
protocol's shape), then closed by uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import Unavailable

RETRY_AFTER_S = 1


def shutting_down() -> Unavailable:
    return Unavailable("the server is shutting down; retry on another replica",
                       retry_after_s=RETRY_AFTER_S)


class Drain:
    """Counts in-flight API requests and tells them when the server stops waiting for them.
    Used on the serving event loop only."""

    def __init__(self) -> None:
        self.draining = False
        self.ended = asyncio.Event()
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def request(self) -> Iterator[None]:
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no API request is in flight; False if timeout_s passed first."""
        if self.num_in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def end(self) -> None:
        self.ended.set()
