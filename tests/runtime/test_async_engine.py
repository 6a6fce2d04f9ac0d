"""AsyncLLM over the session engine: concurrent streams, deltas, early exit, abort, bad input.

pytest-asyncio is not a dependency: each test drives its own event loop with asyncio.run.
"""

from __future__ import annotations

import asyncio
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
    assert len(stream) == GREEDY.max_tokens  # one output per generated token
    assert all(len(out.delta_token_ids) == 1 for out in stream)
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
