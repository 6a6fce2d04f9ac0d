"""Several candidates for one prompt (`n` > 1, vLLM's parallel sampling).

Each candidate is its own request (`n` = 1): candidate i samples
with seed + i (mod 2**64) when the request is seeded, as vLLM's child requests do; unseeded,
each draws from the engine's default generator, as any unseeded request does (their draws
interleave with the batch's, so they differ from each other and are not reproducible, which is
all OpenAI promises without a seed). Candidate 0 is admitted first; the others once it has
sampled its first token, by which time the prompt's full pages are in the (tenant-salted)
prefix cache: they map those pages (refcounted, tags recorded as for any hit) instead of
computing them again. Only the last, partial page of the prompt is computed once per candidate.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from runtime.input_processor import ProcessedPrompt, Prompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.async_engine import AsyncLLM

SEED_MODULUS = 1 << 64


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Candidate `index`'s parameters: n = 1, seed + index when seeded."""
    seed = None if params.seed is None else (params.seed + index) % SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)


def child_id(request_id: str, index: int) -> str:
    """Candidate 0 keeps the request's id (aborts and drills by id reach it); others get #i."""
    return request_id if index == 0 else f"{request_id}#{index}"


async def generate_candidates(llm: AsyncLLM, prompt: Prompt, params: SamplingParams,
                              *, request_id: str, tenant: str = "default",
                              ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(candidate index, output) as each candidate streams, until every one has finished.
    The first candidate's error is raised; leaving early aborts every candidate."""
    if params.n == 1:
        async for out in llm.generate(prompt, params, request_id=request_id, tenant=tenant):
            yield 0, out
        return
    # NOTE: processed once, in a pool thread; every candidate is admitted with the same ids.
    ids = (prompt if isinstance(prompt, ProcessedPrompt)
           else await asyncio.to_thread(llm.engine.processor.process, prompt))
    events: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def run(index: int) -> None:
        try:
            async for out in llm.generate(ids, child_params(params, index), tenant=tenant,
                                          request_id=child_id(request_id, index)):
                events.put_nowait((index, out))
        except Exception as e:  # raised to the caller through the queue
            events.put_nowait((index, e))

    tasks = [asyncio.create_task(run(0))]
    live = params.n
    try:
        while live:
            index, item = await events.get()
            if isinstance(item, Exception):
                raise item
            if len(tasks) == 1:  # candidate 0 is past prefill: its full pages are cached
                tasks += [asyncio.create_task(run(i)) for i in range(1, params.n)]
            live -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merge(outputs: list[RequestOutput]) -> RequestOutput:
    """The candidates' final outputs (by index) as one RequestOutput with n completions;
    cached tokens are candidate 0's (the prompt counted once)."""
    first = outputs[0]
    completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)]
    error = next((o.error for o in outputs if o.error is not None), None)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions,
                         all(o.finished for o in outputs), first.num_cached_tokens, error)

