"""One generation relayed from the gateway to HTTP. The first chunk is awaited before a status
line is chosen, so a failure before the first token gets its own HTTP status; a failure after
it can only travel inside the stream. Every outcome is counted for the status page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.client import AsyncStream, Chunk
from gateway.rest.status import ShimStats
from runtime.errors import TesseraError


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Relay:
    def __init__(self, stream: AsyncStream, stats: ShimStats, route: str) -> None:
        self.stream, self.stats, self.route = stream, stats, route
        self._it: AsyncIterator[Chunk] | None = None
        self._first: Chunk | None = None
        self._finished = False

    async def start(self) -> Relay:
        self._it = aiter(self.stream)
        try:
            self._first = await anext(self._it)
        except StopAsyncIteration:
            self._finish("OK")
        except TesseraError as e:
            self._finish(e.reason)
            raise
        except BaseException:
            self._finish("CANCELLED")
            raise
        return self

    def _finish(self, reason: str) -> None:
        if not self._finished:
            self._finished = True
            self.stats.record(self.route, reason, self.stream.usage)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The first chunk, then the rest; the upstream call is cancelled if we stop early."""
        assert self._it is not None
        try:
            if self._first is not None:
                yield self._first
            if not self._finished:
                async for chunk in self._it:
                    yield chunk
                self._finish("OK")
        except TesseraError as e:
            self._finish(e.reason)
            raise
        finally:
            if not self._finished:
                self._finish("CANCELLED")
                self.stream.cancel()

    async def text(self) -> str:
        return "".join([c.text async for c in self.chunks()])
