"""Chaos over REST and gRPC at once: impatient clients disconnect, time out or cancel at random
points (before admission, in prefill, mid-stream, non-streaming), interleaved with clients
that wait for their answers. Afterwards every patient client got its complete, correct
answer, the worker is back to idle (free + cached = total, nothing running), no engine loop
died, and a fresh request is served within seconds."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import pytest

from gateway.client import NO_RETRY, AsyncClient, Client
from tests.gateway.conftest import wait_for
from tests.rest.conftest import KEYS, MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PATIENT_PROMPTS = ["The capital of France is", "Water boils at", "def add(a, b):",
                   "My favourite colour is"]
PATIENT_TOKENS = 12
LONG_PROMPT = "Tell me everything about the history of the printing press. " * 24
ORPHAN_TOKENS = 380  # what an impatient client's request would cost if it were left running
N_IMPATIENT = 36
SEED = 20261130


def _pool(shim):
    return shim.runner.gateway.pools[MODEL]


def _patient_reference(shim) -> dict[str, str]:
    with Client(shim.runner.target, api_key=KEYS["bob"]) as client:
        return {p: "".join(c.text for c in client.generate(
            p, max_tokens=PATIENT_TOKENS, temperature=0.0, ignore_eos=True))
            for p in PATIENT_PROMPTS}


async def _patient_rest(http: httpx.AsyncClient, shim, prompt: str) -> tuple[str, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": PATIENT_TOKENS, "temperature": 0,
            "ignore_eos": True}
    r = await http.post("/v1/completions", json=body, headers=shim.headers("bob"), timeout=300)
    r.raise_for_status()
    return prompt, r.json()["choices"][0]["text"]


async def _patient_grpc(client: AsyncClient, prompt: str) -> tuple[str, str]:
    stream = client.generate(prompt, model=MODEL, max_tokens=PATIENT_TOKENS, temperature=0.0,
                             ignore_eos=True)
    return prompt, "".join([c.text async for c in stream])


async def _impatient(rng: random.Random, http: httpx.AsyncClient, grpc_client: AsyncClient,
                     shim, kind: str) -> None:
    """One client that leaves early; which stage it reaches depends on the load it meets."""
    prompt = LONG_PROMPT if rng.random() < 0.3 else rng.choice(PATIENT_PROMPTS)
    wait_s = rng.choice([0.0, 0.001, 0.05, 0.3, 1.0, 3.0])
    if kind == "rest-stream":
        body = {"model": MODEL, "stream": True, "max_tokens": ORPHAN_TOKENS, "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt}]}
        leave_after = rng.randint(0, 20)
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body,
                                   headers=shim.headers(), timeout=wait_s + 0.5) as r:
                seen = 0
                async for _ in r.aiter_lines():
                    seen += 1
                    if seen > leave_after:
                        break  # the connection closes here, mid-stream
        except httpx.TimeoutException:
            pass  # gave up before (or between) events
    elif kind in ("rest-unary", "ai-run"):
        path, body = (("/v1/completions", {"model": MODEL, "prompt": prompt}) if kind ==
                      "rest-unary" else (f"/ai/run/{MODEL}", {"prompt": prompt}))
        body.update(max_tokens=ORPHAN_TOKENS, ignore_eos=True)
        try:
            await http.post(path, json=body, headers=shim.headers(), timeout=wait_s + 0.01)
        except httpx.TimeoutException:
            pass  # the client gave up and hung up
    elif kind == "grpc-deadline":
        stream = grpc_client.generate(prompt, model=MODEL, max_tokens=ORPHAN_TOKENS,
                                      ignore_eos=True, timeout_s=wait_s + 0.01)
        try:
            async for _ in stream:
                pass
        except Exception as e:  # the deadline: checked below by reason
            assert e.reason in ("DEADLINE_EXCEEDED", "CANCELLED"), e
    else:  # grpc-cancel: a task cancelled at a random moment
        stream = grpc_client.generate(prompt, model=MODEL, max_tokens=ORPHAN_TOKENS,
                                      ignore_eos=True)

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(wait_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_impatient_clients_leave_no_trace(shim) -> None:
    pool = _pool(shim)
    crashed_before = pool.stats.crashed
    expected = _patient_reference(shim)
    rng = random.Random(SEED)
    kinds = [rng.choice(["rest-stream", "rest-unary", "ai-run", "grpc-deadline",
                         "grpc-cancel"]) for _ in range(N_IMPATIENT)]

    async def main() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=shim.url) as http, \
                AsyncClient(shim.runner.target, api_key=KEYS["acme"], retry=NO_RETRY) as rude, \
                AsyncClient(shim.runner.target, api_key=KEYS["bob"]) as polite:
            patient = []
            impatient = []
            for i, kind in enumerate(kinds):
                impatient.append(asyncio.create_task(_impatient(rng, http, rude, shim, kind)))
                if i % 6 == 0:
                    prompt = PATIENT_PROMPTS[(i // 6) % len(PATIENT_PROMPTS)]
                    patient.append(asyncio.create_task(
                        _patient_rest(http, shim, prompt) if i % 12 == 0
                        else _patient_grpc(polite, prompt)))
                await asyncio.sleep(rng.random() * 0.2)
            await asyncio.gather(*impatient)
            return await asyncio.gather(*patient)

    answers = asyncio.run(asyncio.wait_for(main(), 480))
    assert len(answers) == 6
    for prompt, text in answers:
        assert text == expected[prompt], prompt
    started = time.monotonic()
    wait_for(shim.workers_idle, 15, "every page back and nothing running")
    drained_s = time.monotonic() - started
    health = [shim.runner.call(w.probe_health()) for w in pool.ready()]
    assert health and all(h is not None and h.engine_alive for h in health)
    assert pool.stats.crashed == crashed_before
    with Client(shim.runner.target, api_key=KEYS["acme"]) as client:
        begun = time.monotonic()
        text = "".join(c.text for c in client.generate(PATIENT_PROMPTS[0], model=MODEL,
                                                        max_tokens=4, temperature=0.0))
    assert text.strip() and time.monotonic() - begun < 10
    print(f"chaos: {Counter(kinds)}; idle {drained_s:.1f} s after the last client left")
