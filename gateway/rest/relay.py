"""One generation relayed from the gateway to HTTP. The first chunk is awaited before a status
line is chosen, so a failure before the first token gets its own HTTP status; a failure after
it can only travel inside the stream. A client that goes away, or a server that stops waiting
for it, cancels the upstream call at once. Every outcome is counted for the status page."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from gateway.client import AsyncStream, Chunk
from gateway.rest.drain import Drain, shutting_down
from gateway.rest.status import ShimStats
from runtime.errors import TesseraError


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body was read already: nothing else can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Relay:
    def __init__(self, stream: AsyncStream, request: Request, route: str) -> None:
        self.stream, self.route = stream, route
        self.stats: ShimStats = request.app.state.stats
        self._drain: Drain = request.app.state.drain
        self._receive = request.receive
        self._request_state = request.state
        self._it: AsyncIterator[Chunk] | None = None
        self._first: Chunk | None = None
        self._finished = False
        self._ended_by_server = False
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> Relay:
        self._watcher = asyncio.create_task(self._watch())
        self._it = aiter(self.stream)
        try:
            self._first = await anext(self._it)
        except StopAsyncIteration:
            self._finish("OK")
        except TesseraError as e:
            raise self._failed(e) from None
        except BaseException:
            self._finish("CANCELLED")
            self.stream.cancel()
            raise
        return self

    async def _watch(self) -> None:
        """Until the relay finishes (in admission, prefill or decode): a client that goes away
        or a server that stops waiting for it (Drain.end) cancels the upstream call."""
        gone = asyncio.ensure_future(_disconnected(self._receive))
        ended = asyncio.ensure_future(self._drain.ended.wait())
        try:
            done, _ = await asyncio.wait({gone, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            ended.cancel()
        self._ended_by_server = ended in done and gone not in done
        self.stream.cancel()

    def _failed(self, error: TesseraError) -> TesseraError:
        """The error to answer with: UNAVAILABLE when the server ended the call."""
        if self._ended_by_server:
            error = shutting_down()
        self._finish(error.reason)
        return error

    def _finish(self, reason: str) -> None:
        if not self._finished:
            self._finished = True
            if self._watcher is not None:
                self._watcher.cancel()
            self.stats.record(self.route, reason, self.stream.usage)
            self._request_state.recorded = True  # NOTE: the error handlers count it no more

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
            raise self._failed(e) from None
        finally:
            if not self._finished:
                self._finish("CANCELLED")
                self.stream.cancel()

    async def text(self) -> str:
        return "".join([c.text async for c in self.chunks()])

    def close(self) -> None:
        """Give up on a started relay that will not be read (a sibling prompt failed)."""
        if not self._finished:
            self._finish("CANCELLED")
            self.stream.cancel()


async def merged(relays: list[Relay]) -> AsyncIterator[tuple[int, Chunk]]:
    """(relay position, chunk) from every relay as chunks arrive; the first error is raised,
    and leaving early (or an error) cancels every relay's upstream call."""
    if len(relays) == 1:
        async for chunk in relays[0].chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, relay: Relay) -> None:
        try:
            async for chunk in relay.chunks():
                queue.put_nowait((k, chunk))
            queue.put_nowait((k, None))
        except Exception as e:  # raised to the reader through the queue
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, r)) for k, r in enumerate(relays)]
    live = len(tasks)
    try:
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
