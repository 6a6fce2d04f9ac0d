"""Scale to zero and back under a bounded concurrent load: clients that come in bursts (the pool
reaped to zero between them) and one that arrives at random moments, around the idle TTL, so
requests meet the pool starting, serving, draining and empty. No request fails, and every
answer is the greedy answer of the model."""

from __future__ import annotations

import random
import threading
import time

import pytest

from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.template import ForkedProcess
from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
IDLE_TTL_S = 0.5
BURSTS = 3
CLIENTS = 3
REQUESTS_PER_BURST = 2


def _answer(client: Client) -> list[int]:
    stream = client.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    return [t for chunk in stream for t in chunk.token_ids]


def test_scale_to_zero_and_back_under_load_fails_no_request() -> None:
    runner = GatewayRunner([pool_config(min_workers=0, max_workers=2, idle_ttl_s=IDLE_TTL_S)],
                           api_keys()).start(wait_ready=False)
    pool = runner.gateway.pools[MODEL]
    answers: list[list[int]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    rng = random.Random(31)

    def record(client: Client) -> None:
        try:
            tokens = _answer(client)
            with lock:
                answers.append(tokens)
        except BaseException as e:  # every failure is the test's finding
            with lock:
                failures.append(e)

    def burst(client: Client, start: threading.Barrier) -> None:
        start.wait()
        time.sleep(rng.uniform(0, 0.05))
        for _ in range(REQUESTS_PER_BURST):
            record(client)

    def stray() -> None:  # arrives at any phase of the pool's life, TTL-sized gaps
        with Client(runner.target, api_key=KEYS["acme"]) as client:
            while not stop.is_set():
                record(client)
                stop.wait(rng.uniform(0.5 * IDLE_TTL_S, 3 * IDLE_TTL_S))

    try:
        template = pool._template
        assert template is not None
        runner.call(template.ready.wait(), timeout_s=300)
        assert template.alive, template.failed
        clients = [Client(runner.target, api_key=KEYS["acme"]) for _ in range(CLIENTS)]
        strayer = threading.Thread(target=stray)
        strayer.start()
        for _ in range(BURSTS):
            wait_for(lambda: not pool.live() or bool(failures), 120, "the pool back at zero")
            start = threading.Barrier(CLIENTS)
            threads = [threading.Thread(target=burst, args=(c, start)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert not any(t.is_alive() for t in threads)
        stop.set()
        strayer.join(300)
        for c in clients:
            c.close()
        assert not failures, failures
        assert len(answers) >= BURSTS * CLIENTS * REQUESTS_PER_BURST
        assert len({tuple(a) for a in answers}) == 1 and len(answers[0]) == 4
        assert pool.stats.reaped >= BURSTS - 1 and pool.stats.spawned >= BURSTS
        assert pool.stats.crashed == 0
        assert all(isinstance(w.process, ForkedProcess) for w in pool.live())
    finally:
        stop.set()
        runner.stop()
