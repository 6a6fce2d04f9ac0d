"""AsyncLLM over the session engine: concurrent streams, deltas, early exit, abort, bad input.

pytest-asyncio is not a dependency: each test drives its own event loop with asyncio.run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime.async_engine import AsyncLLM
from runtime.errors import ContextLengthExceeded, InvalidArgument
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at", "My name is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def offline(llm) -> list[RequestOutput]:
    """The offline API's outputs for PROMPTS (computed before any engine thread runs)."""
    return llm.generate(PROMPTS, GREEDY)


@pytest.fixture
def allm(engine):
    front = AsyncLLM(engine)
    yield front
    front.shutdown()
    assert not front._thread.is_alive(), "the engine thread outlived shutdown()"


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(main(), TIMEOUT_S)
    return asyncio.run(bounded())


async def collect(allm: AsyncLLM, prompt: str | list[int], params: SamplingParams,
                  request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in allm.generate(prompt, params, request_id=request_id)]


async def wait_until_gone(allm: AsyncLLM, request_id: str) -> None:
    while await allm.call(lambda: request_id in allm.engine.requests):
        await asyncio.sleep(0.05)


def request_pages(engine) -> int:
    """Pages held by requests: drop the prefix cache's own holds first."""
    engine.prefix_cache.clear()
    return engine.pool.num_used_pages


async def num_used_pages(allm: AsyncLLM) -> int:
    return await allm.call(lambda: request_pages(allm.engine))


def test_concurrent_streams_match_offline_greedy(allm, offline):
    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(allm, p, GREEDY) for p in PROMPTS))

    streams = run(main)
    for stream, expected in zip(streams, offline, strict=True):
        final = stream[-1]
        assert final.finished and all(not o.finished for o in stream[:-1])
        assert final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.outputs[0].text == expected.outputs[0].text


def test_stream_deltas_concatenate_to_the_final_output(allm, offline):
    stream = run(lambda: collect(allm, PROMPTS[0], GREEDY, request_id="deltas"))
    final = stream[-1].outputs[0]
    # One output per step, unless the consumer lagged and some were merged.
    assert len(stream) <= GREEDY.max_tokens
    assert sum(len(out.delta_token_ids) for out in stream) == GREEDY.max_tokens
    assert [t for out in stream for t in out.delta_token_ids] == final.token_ids
    assert "".join(out.delta_text for out in stream) == final.text
    assert final.text == offline[0].outputs[0].text
    assert {out.request_id for out in stream} == {"deltas"}


def test_leaving_the_stream_early_aborts_the_request_and_frees_its_pages(allm):
    async def main() -> tuple[int, int]:
        received = 0
        async for out in allm.generate(PROMPTS[1], LONG, request_id="quitter"):
            received += len(out.delta_token_ids)
            if received == 3:
                break
        await asyncio.wait_for(wait_until_gone(allm, "quitter"), 30)
        return received, await num_used_pages(allm)

    received, used_after = run(main)
    assert received == 3
    assert used_after == 0
    assert not allm.engine.has_unfinished_requests()


def test_abort_ends_the_stream_with_finish_reason_abort(allm):
    async def main() -> tuple[list[RequestOutput], int]:
        outputs = []
        used_while_running = 0
        async for out in allm.generate(PROMPTS[2], LONG, request_id="to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                used_while_running = await num_used_pages(allm)
                await allm.abort("to-abort")
        return outputs, used_while_running

    outputs, used_while_running = run(main)
    final = outputs[-1]
    assert used_while_running > 0
    assert final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert final.error is None
    assert len(final.outputs[0].token_ids) < LONG.max_tokens
    assert "to-abort" not in allm.engine.requests
    assert request_pages(allm.engine) == 0


def test_abort_of_an_unknown_request_is_harmless(allm, offline):
    async def main() -> list[RequestOutput]:
        await allm.abort("never-existed")
        return await collect(allm, PROMPTS[0], GREEDY)

    assert run(main)[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids


def test_bad_requests_raise_typed_errors_and_other_streams_continue(allm, offline):
    engine = allm.engine
    longer = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def all_decoding() -> bool:
        return len(engine.requests) == len(PROMPTS) and all(
            s.output_token_ids for s in engine.requests.values())

    async def main() -> tuple[list[list[RequestOutput]], list[BaseException]]:
        good = [asyncio.create_task(collect(allm, p, longer, request_id=f"good-{i}"))
                for i, p in enumerate(PROMPTS)]
        while not await allm.call(all_decoding):  # bad requests arrive mid-flight
            await asyncio.sleep(0.02)
        errors: list[BaseException] = []
        for prompt, rid in (("Hello", "good-0"),  # reuses a live request id
                            ("", None), ([1, 49152], None), ([1] * engine.max_model_len, None)):
            try:
                await collect(allm, prompt, GREEDY, request_id=rid)
            except Exception as e:  # each one is checked below
                errors.append(e)
        return await asyncio.gather(*good), errors

    streams, errors = run(main)
    assert [type(e) for e in errors] == [InvalidArgument, InvalidArgument, InvalidArgument,
                                         ContextLengthExceeded]
    assert [e.reason for e in errors] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT",
                                          "INVALID_ARGUMENT", "CONTEXT_LENGTH_EXCEEDED"]
    assert "good-0" in str(errors[0]) and "already in flight" in str(errors[0])
    assert "empty" in str(errors[1])
    assert "token ids" in str(errors[2])
    for stream, expected in zip(streams, offline, strict=True):
        final = stream[-1].outputs[0]
        assert final.finish_reason == "length"
        assert len(final.token_ids) == longer.max_tokens
        # Greedy: the first tokens are the offline run's.
        assert final.token_ids[: GREEDY.max_tokens] == expected.outputs[0].token_ids


def test_a_caller_loop_closing_mid_stream_does_not_stop_the_engine(allm, offline):
    loop = asyncio.new_event_loop()
    stream = allm.generate(PROMPTS[3], LONG, request_id="orphan")
    try:
        first = loop.run_until_complete(asyncio.wait_for(stream.__anext__(), TIMEOUT_S))
    finally:
        loop.close()  # the stream is left suspended: nothing tells the engine
    assert first.request_id == "orphan" and not first.finished
    # The engine finds the caller gone, drops the request and keeps serving the others.
    run(lambda: wait_until_gone(allm, "orphan"))
    assert allm._thread.is_alive()
    again = run(lambda: collect(allm, PROMPTS[0], GREEDY))
    assert again[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids
    assert request_pages(allm.engine) == 0
    asyncio.run(stream.aclose())


def test_shutdown_stops_the_engine_thread(engine):
    front = AsyncLLM(engine)
    assert front._thread.is_alive()
    front.shutdown()
    assert not front._thread.is_alive()


def _block_engine_thread(allm: AsyncLLM) -> threading.Event:
    """Hold the engine thread inside a command until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(TIMEOUT_S)

    allm._submit(hold)
    assert started.wait(TIMEOUT_S)
    return release


def test_a_call_whose_caller_gave_up_before_it_ran_is_skipped(allm):
    ran: list[str] = []
    release = _block_engine_thread(allm)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(allm.call(lambda: ran.append("late")), 0.2)
        release.set()
        assert await allm.call(lambda: "next") == "next"

    run(main)
    assert ran == []
    assert allm.liveness().alive


def test_a_caller_that_gives_up_while_its_call_runs_does_not_kill_the_loop(allm, offline):
    # The regression: a poll with a deadline shorter than the step it waited on.
    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(allm.call(lambda: time.sleep(0.5) or "done"), 0.1)
        await asyncio.sleep(0.6)

    run(main)
    assert allm.liveness().alive
    again = run(lambda: collect(allm, PROMPTS[0], GREEDY))
    assert again[-1].outputs[0].token_ids == offline[0].outputs[0].token_ids


def test_a_raising_call_reaches_its_caller_and_the_loop_goes_on(allm):
    async def main() -> int:
        with pytest.raises(ZeroDivisionError):
            await allm.call(lambda: 1 // 0)
        with pytest.raises(KeyboardInterrupt):  # even a BaseException stays the caller's
            await allm.call(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
        return await allm.call(lambda: 7)

    assert run(main) == 7
    assert allm.liveness().alive


def test_a_slow_step_does_not_delay_liveness_or_status_reads(allm):
    release = _block_engine_thread(allm)
    try:
        time.sleep(0.3)
        started = time.perf_counter()
        pulse = allm.liveness()
        snapshot = allm.snapshot
        elapsed = time.perf_counter() - started
    finally:
        release.set()
    assert pulse.alive and pulse.step_running_s >= 0.3
    assert snapshot.stats.num_pages == allm.engine.pool.num_pages
    assert elapsed < 0.05  # read beside the engine thread, not through it
    run(lambda: allm.call(lambda: None))
    # NOTE: the call's answer is sent from inside the pass that ran it, which may still be
    # ending (the held pass's clock) when the caller reads liveness: wait for that pass's end.
    deadline = time.monotonic() + TIMEOUT_S
    while allm.liveness().step_running_s >= 0.3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allm.liveness().step_running_s < 0.3


def test_a_killed_loop_says_so(engine):
    front = AsyncLLM(engine)
    front.inject_loop_fault("kill")
    front._thread.join(TIMEOUT_S)
    pulse = front.liveness()
    assert not pulse.alive
    assert pulse.error is not None and "LoopFault" in pulse.error


def test_a_stalled_consumer_holds_one_merged_output_not_one_per_step(allm, offline):
    async def main() -> list[RequestOutput]:
        stream = allm.generate(PROMPTS[0], GREEDY, request_id="stalled")
        first = await stream.__anext__()
        await asyncio.to_thread(lambda: _wait_gone(allm, "stalled"))  # not reading meanwhile
        return [first] + [out async for out in stream]

    outputs = run(main)
    final = outputs[-1].outputs[0]
    assert len(outputs) == 2  # everything after the first output arrived merged
    assert "".join(o.delta_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids
    assert final.token_ids == offline[0].outputs[0].token_ids


def _wait_gone(allm: AsyncLLM, request_id: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while request_id in allm.engine.requests and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_heap_is_trimmed_once_after_the_loop_goes_idle_and_not_while_idle(engine,
                                                                             monkeypatch):
    # glibc keeps what a step freed; the loop hands it back to the OS once a whole wait
    # passes with no work (never between back-to-back requests), and only once per busy spell.
    trims: list[float] = []
    monkeypatch.setattr("runtime.async_engine.release_free_heap",
                        lambda: trims.append(time.monotonic()) or True)
    front = AsyncLLM(engine)
    try:
        time.sleep(1.2)
        assert trims == []  # idle from the start: nothing was freed
        outs = run(lambda: collect(front, "Water boils at", SamplingParams(max_tokens=3)))
        finished = time.monotonic()
        assert outs[-1].finished
        deadline = finished + 5.0
        while not trims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(trims) == 1 and trims[0] - finished >= 0.25  # after a wait, not at once
        time.sleep(1.2)
        assert len(trims) == 1
    finally:
        front.shutdown()


def test_when_idle_runs_once_on_the_engine_thread_beside_requests(engine) -> None:
    ran: list[str] = []
    front = AsyncLLM(engine, when_idle=lambda: ran.append(threading.current_thread().name))
    try:
        first = run(lambda: collect(front, PROMPTS[0], GREEDY))
        assert first[-1].finished
        deadline = time.monotonic() + 30
        while not ran and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ran == ["tessera-engine"]
        run(lambda: collect(front, PROMPTS[1], GREEDY))
        time.sleep(1.2)  # two more idle waits
        assert ran == ["tessera-engine"]
    finally:
        front.shutdown()


def test_a_failing_when_idle_task_leaves_the_loop_serving(engine) -> None:
    def boom() -> None:
        raise RuntimeError("planted")
    front = AsyncLLM(engine, when_idle=boom)
    try:
        time.sleep(1.0)  # the idle wait passes and boom runs
        assert front.liveness().error is None and front.is_alive
        outs = run(lambda: collect(front, PROMPTS[2], GREEDY))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        front.shutdown()
