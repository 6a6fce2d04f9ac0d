"""The engine counts where its time goes (runtime/step_times.py): every step by kind, its
compute part, its rows; and the asyncio front's loop around the steps."""

from __future__ import annotations

import asyncio

import pytest

from runtime.async_engine import AsyncLLM
from runtime.sampling_params import SamplingParams
from runtime.step_times import EngineTimes

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_a_request_is_one_mixed_step_then_one_decode_step_per_further_token(engine):
    before = engine.times.copy()
    prompt_tokens = len(engine.processor.process(PROMPT).token_ids)
    engine.add_request("times-1", PROMPT, GREEDY)
    while "times-1" in engine.requests:
        engine.step()
    t = engine.times
    decode, mixed = t.decode, t.mixed
    assert mixed.steps - before.mixed.steps == 1
    assert mixed.prefill_tokens - before.mixed.prefill_tokens == prompt_tokens
    assert decode.steps - before.decode.steps == GREEDY.max_tokens - 1
    assert decode.decode_rows - before.decode.decode_rows == GREEDY.max_tokens - 1
    for now, then in ((decode, before.decode), (mixed, before.mixed)):
        compute, wall = now.compute_s - then.compute_s, now.wall_s - then.wall_s
        assert 0 < compute <= wall


def test_a_snapshot_copy_does_not_move_with_later_steps(engine):
    snap = engine.times.copy()
    steps = snap.decode.steps
    engine.add_request("times-2", PROMPT, GREEDY)
    while "times-2" in engine.requests:
        engine.step()
    assert snap.decode.steps == steps < engine.times.decode.steps
    assert isinstance(snap, EngineTimes) and snap.kind("decode") is snap.decode
    with pytest.raises(KeyError):
        snap.kind("prefill")


@pytest.mark.slow
def test_the_loop_counts_its_commands_publishing_idle_and_cpu(engine):
    llm = AsyncLLM(engine)
    try:
        before = llm.snapshot.times

        async def run() -> None:
            async for _ in llm.generate(PROMPT, GREEDY, request_id="times-3"):
                pass
            await asyncio.sleep(0.6)  # one idle wait of the loop, at least

        asyncio.run(run())
        after = llm.snapshot.times
    finally:
        llm.shutdown()
    assert after.decode.steps - before.decode.steps == GREEDY.max_tokens - 1
    for field in ("commands_s", "publish_s", "idle_s", "loop_cpu_s"):
        assert getattr(after, field) > getattr(before, field), field
