"""An asyncio front for the engine: per-request output streams over a step loop in a thread.

The engine is not thread-safe, so every call into it (add, abort, step) runs on the engine
thread; asyncio callers submit commands and await their futures. The worker process wraps this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from runtime.engine import LLMEngine
from runtime.errors import RequestCancelled
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

log = logging.getLogger("tessera.async_engine")


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="tessera-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread and return its result (or raise its exception)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    async def generate(self, prompt: str | list[int], params: SamplingParams, *,
                       request_id: str | None = None,
                       tenant: str = "default") -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request; leaving the loop early aborts the request."""
        rid = request_id or f"req-{next(self._ids)}"
        out_q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        stream = (asyncio.get_running_loop(), out_q)

        def add() -> None:
            self.engine.add_request(rid, prompt, params, tenant)
            # NOTE: registered only once admitted, so a rejected duplicate id never takes
            # over (or, on the way out, removes) the live request's stream.
            self._streams[rid] = stream

        finished = False
        try:
            await self.call(add)
            while not finished:
                out = await out_q.get()
                finished = out.finished
                yield out
        finally:
            abort = not finished
            self._commands.put((lambda: self._release(rid, stream, abort),
                                concurrent.futures.Future()))
            self._wake.set()

    def _release(self, request_id: str, stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue],
                 abort: bool) -> None:
        """Engine thread: drop a stream that ended, aborting its request if still running."""
        if self._streams.get(request_id) is not stream:
            return  # never admitted, or the id now belongs to a newer request
        del self._streams[request_id]
        if abort:
            self.engine.abort_request(request_id, RequestCancelled("the client went away"))

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self._abort_and_publish(request_id))

    def _abort_and_publish(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._publish([out])

    def _loop(self) -> None:
        while not self._stop:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # the engine already failed the step's requests; keep serving
                log.exception("engine step raised")
                continue
            self._publish(outputs)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, q = target
                try:
                    loop.call_soon_threadsafe(q.put_nowait, out)
                except RuntimeError:  # the caller's event loop is closed: nobody listens
                    del self._streams[out.request_id]
                    self.engine.abort_request(out.request_id,
                                              RequestCancelled("the client went away"))
