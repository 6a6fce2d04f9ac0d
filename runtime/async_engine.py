"""An asyncio front for the engine: per-request output streams over a step loop in a thread.

The engine is not thread-safe, so every call into it (add, abort, step) runs on the engine
thread; asyncio callers submit commands and await their futures. Prompts are processed
(runtime/input_processor.py) in a thread pool before they reach the engine thread, and status
reads see the snapshot the loop publishes after each pass, so neither waits behind a long step.
The worker process wraps this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from runtime.engine import EngineStats, LLMEngine
from runtime.errors import RequestCancelled
from runtime.heap import release_free_heap
from runtime.input_processor import ProcessedPrompt, Prompt
from runtime.outputs import EngineCoreOutput, OutputAccumulator, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.step_times import EngineTimes

log = logging.getLogger("tessera.async_engine")


@dataclass(frozen=True)
class EngineSnapshot:
    """What the loop published after its last pass: safe to read from any thread."""

    stats: EngineStats
    integrity_checks: int
    integrity_mismatches: int
    times: EngineTimes  # where the loop's time went, as of that pass (a copy)


@dataclass(frozen=True)
class Liveness:
    """The engine loop's pulse. `step_running_s` is how long the current pass has run (0 when
    the loop is between passes); a dead loop has `alive` False and says why."""

    alive: bool
    last_pass_age_s: float
    step_running_s: float
    error: str | None = None


class _OutputSlot:
    """One request's outputs on their way to its consumer: the engine thread pushes deltas,
    the consumer's event loop rebuilds RequestOutputs from them (`OutputAccumulator`, set at
    admission). A consumer that lags gets the deltas merged, so what waits for a stalled
    client is one delta, not one per step."""

    def __init__(self) -> None:
        self.accumulator: OutputAccumulator | None = None
        self._pending: EngineCoreOutput | None = None
        self._ready = asyncio.Event()

    def push(self, delta: EngineCoreOutput) -> None:  # on the consumer's event loop
        prev = self._pending
        if prev is not None:
            if prev.finished:
                return  # nothing follows a final output
            delta = prev.merge(delta)
        self._pending = delta
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        delta, self._pending = self._pending, None
        assert delta is not None and self.accumulator is not None
        return self.accumulator.add(delta)


def _push_all(pushes: list[tuple[_OutputSlot, EngineCoreOutput]]) -> None:
    """On a consumer's event loop: one step's outputs into their slots."""
    for slot, out in pushes:
        slot.push(out)


class LoopFault(BaseException):
    """Drills only (runtime.faults): ends the engine thread as a fatal bug would. A
    BaseException so that the loop's own `except Exception` does not keep it alive."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, when_idle: Callable[[], Any] | None = None) -> None:
        """`when_idle`: run once on the engine thread after its first wait with nothing to do
        (0.5 s), e.g. first-use costs a spawned worker leaves until after it reports ready."""
        self.engine = engine
        self._when_idle = when_idle
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _OutputSlot]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._stepped = False  # a step ran since the heap was last trimmed
        self._ids = itertools.count()
        self._last_pass_at = time.monotonic()
        self._pass_started_at: float | None = None
        self._fatal: str | None = None
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- what other threads may read ----------------------------------------------------------

    def liveness(self) -> Liveness:
        now = time.monotonic()
        started = self._pass_started_at
        return Liveness(self._thread.is_alive(), now - self._last_pass_at,
                        0.0 if started is None else now - started, self._fatal)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_until_stopped(self) -> None:
        """Block until the engine loop has ended (shut down, or dead: `liveness().error`)."""
        self._thread.join()

    # -- commands -----------------------------------------------------------------------------

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread and return its result (or raise its exception). A
        caller that gives up (cancellation, a deadline) before fn starts means fn never runs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(fn, fut)
        return await asyncio.wrap_future(fut)

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run fn on the engine thread, later, without waiting (cleanup from a `finally`
        whose task may be cancelled); its exception, if any, is dropped."""
        self._submit(fn)

    def _submit(self, fn: Callable[[], Any],
                fut: concurrent.futures.Future | None = None) -> None:
        self._commands.put((fn, fut or concurrent.futures.Future()))
        self._wake.set()

    async def generate(self, prompt: Prompt, params: SamplingParams, *,
                       request_id: str | None = None,
                       tenant: str = "default") -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request; leaving the loop early aborts the request."""
        rid = request_id or f"req-{next(self._ids)}"
        # NOTE: processed here, in a pool thread (once: a ProcessedPrompt passes as it is), so
        # a megabyte prompt never stalls the step; the engine thread admits it unchecked.
        processed = (prompt if isinstance(prompt, ProcessedPrompt)
                     else await asyncio.to_thread(self.engine.processor.process, prompt))
        stream = self.stream(rid, lambda: self.engine.add_request(rid, processed, params, tenant))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # now, not when the event loop finalizes it

    async def stream(self, request_id: str,
                     admit: Callable[[], object]) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of a request that `admit` puts into the engine (on the engine
        thread: `add_request`, or a KV import's commit); leaving early aborts it."""
        rid = request_id
        slot = _OutputSlot()
        stream = (asyncio.get_running_loop(), slot)

        def add() -> None:
            admit()
            slot.accumulator = self.engine.accumulator_for(rid)
            # NOTE: registered only once admitted, so a rejected duplicate id never takes
            # over (or, on the way out, removes) the live request's stream.
            self._streams[rid] = stream

        finished = False
        try:
            await self.call(add)
            while not finished:
                out = await slot.get()
                finished = out.finished
                yield out
        finally:
            abort = not finished
            self._submit(lambda: self._release(rid, stream, abort))

    def _release(self, request_id: str, stream: tuple[asyncio.AbstractEventLoop, _OutputSlot],
                 abort: bool) -> None:
        """Engine thread: drop a stream that ended, aborting its request if still running."""
        if self._streams.get(request_id) is not stream:
            return  # never admitted, or the id now belongs to a newer request
        del self._streams[request_id]
        if abort:
            self.engine.abort_request_core(request_id, RequestCancelled("the client went away"))

    async def abort(self, request_id: str) -> bool:
        """Abort a request if it is in flight; whether it was."""
        return bool(await self.call(lambda: self._abort_and_publish(request_id)))

    def _abort_and_publish(self, request_id: str) -> bool:
        out = self.engine.abort_request_core(request_id)
        if out is not None:
            self._publish([out])
        return out is not None

    def inject_loop_fault(self, kind: str) -> None:
        """Drills only: `kill` ends the engine thread as a fatal bug would; `wedge` blocks it
        inside a pass for good, as a hung kernel would."""
        if kind not in ("kill", "wedge"):
            raise ValueError(f"unknown loop fault {kind!r}")

        def fault() -> None:
            if kind == "kill":
                raise LoopFault("engine loop killed by a drill")
            threading.Event().wait()

        self._submit(fault)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # recorded for liveness; then the thread ends
            self._fatal = f"{type(e).__name__}: {e}"
            log.critical("engine loop ended: %s", self._fatal, exc_info=True)

    def _loop(self) -> None:
        times = self.engine.times
        cpu_at = time.thread_time()
        while not self._stop:
            self._wake.clear()
            self._pass_started_at = time.monotonic()
            try:
                self._pass()
            except Exception:  # a failed pass must not end the loop
                log.exception("engine loop pass failed; continuing")
            finally:
                self._last_pass_at = time.monotonic()
                self._pass_started_at = None
            cpu_now = time.thread_time()
            times.loop_cpu_s += cpu_now - cpu_at
            cpu_at = cpu_now
            self.snapshot = self._take_snapshot()
            if not self.engine.has_unfinished_requests() and self._commands.empty():
                # NOTE: once idle for a whole wait, the heap the steps freed goes back to the
                # OS (glibc keeps it otherwise: ~20 MB after one 200-token request); never
                # between back-to-back requests, where it would delay the next one.
                idle_from = time.perf_counter()
                woken = self._wake.wait(timeout=0.5)
                times.idle_s += time.perf_counter() - idle_from
                if not woken:
                    self._on_idle()

    def _on_idle(self) -> None:
        if self._when_idle is not None:
            fn, self._when_idle = self._when_idle, None
            try:
                fn()
            except Exception:  # a first-use cost left for later must not end the loop
                log.exception("idle task failed; what it prepares is made on first use")
            self._stepped = True  # its transient buffers go back below
        if self._stepped:
            self._stepped = False
            self.engine.release_idle_memory()
            release_free_heap()

    def _pass(self) -> None:
        times = self.engine.times
        started = time.perf_counter()
        self._run_commands()
        times.commands_s += time.perf_counter() - started
        if not self.engine.has_unfinished_requests():
            return
        self._stepped = True
        try:
            outputs = self.engine.step_core()
        except Exception:  # the engine already failed the step's requests; keep serving
            log.exception("engine step raised")
            return
        started = time.perf_counter()
        self._publish(outputs)
        times.publish_s += time.perf_counter() - started

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it ran
            # NOTE: a running future can no longer be cancelled, so completing it below never
            # raises InvalidStateError, whatever its caller does meanwhile.
            try:
                result = fn()
            except LoopFault:
                fut.set_exception(RuntimeError("engine loop killed (drill)"))
                raise
            except BaseException as e:  # the caller's to handle, never fatal here
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each consumer's event loop
        per step, not one per request (each wake-up takes a core from the next step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_OutputSlot, EngineCoreOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, pushes in by_loop.items():
            try:
                loop.call_soon_threadsafe(_push_all, pushes)
            except RuntimeError:  # the caller's event loop is closed: nobody listens
                for _, out in pushes:
                    del self._streams[out.request_id]
                    self.engine.abort_request_core(out.request_id,
                                                   RequestCancelled("the client went away"))

    def _take_snapshot(self) -> EngineSnapshot:
        counters = self.engine.tracker.counters
        return EngineSnapshot(self.engine.stats(), counters.checks_run, counters.num_mismatches,
                              self.engine.times.copy())
