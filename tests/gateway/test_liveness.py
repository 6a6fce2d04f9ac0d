"""A worker whose engine loop dies or wedges (a drill kills or blocks it once a tenant's request
has streamed) is found by the supervisor's health probe, which never waits on the loop: the
request on it ends with WORKER_LOST within the bound, the worker is replaced, and the next
request is served."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gateway.auth import ApiKeys
from gateway.client import NO_RETRY, Client, WorkerLost
from gateway.runner import GatewayRunner
from tests.gateway.conftest import MODEL, pool_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STUCK_AFTER_S = 3.0
# The probe runs each second and a lost worker's calls fail as soon as it is killed.
BOUND_S = STUCK_AFTER_S + 10
KEYS = {"wedge": "key-wedge", "kill": "key-kill", "ok": "key-ok"}


@pytest.fixture(scope="module")
def runner() -> Iterator[GatewayRunner]:
    keys = ApiKeys.parse(",".join(f"{k}={t}" for t, k in KEYS.items()))
    config = pool_config(min_workers=1, max_workers=1, stuck_after_s=STUCK_AFTER_S,
                         restart_backoff_s=0.1,
                         worker_args=("--fault-loop", "wedge:wedge", "--fault-loop", "kill:kill"))
    runner = GatewayRunner([config], keys).start()
    yield runner
    runner.stop()


def _lose_a_worker(runner: GatewayRunner, tenant: str) -> tuple[float, int]:
    """Stream a request of `tenant` until the drill fires: (seconds from its first token to
    the error, tokens received before it)."""
    client = Client(runner.target, api_key=KEYS[tenant], retry=NO_RETRY)
    stream = client.generate("Count to one hundred:", max_tokens=400, ignore_eos=True)
    tokens, started = 0, 0.0
    with pytest.raises(WorkerLost):
        for chunk in stream:
            tokens += len(chunk.token_ids)
            started = started or time.monotonic()
    elapsed = time.monotonic() - started
    client.close()
    return elapsed, tokens


def _served_normally(runner: GatewayRunner) -> str:
    pool = runner.gateway.pools[MODEL]
    wait_for(lambda: len(pool.ready()) == 1, 240, "a replacement worker")
    with Client(runner.target, api_key=KEYS["ok"]) as client:
        stream = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
        text = "".join(c.text for c in stream)
    assert stream.finish_reason == "length" and text
    return stream.served.worker_id


@pytest.mark.parametrize("drill", ["wedge", "kill"])
def test_a_wedged_or_dead_engine_loop_is_replaced_and_its_request_ends_worker_lost(
        runner, drill):
    pool = runner.gateway.pools[MODEL]
    wait_for(lambda: len(pool.ready()) == 1, 240, "a ready worker")
    first = pool.ready()[0].id
    crashed = pool.stats.crashed
    elapsed, tokens = _lose_a_worker(runner, drill)
    assert tokens >= 1
    assert elapsed < BOUND_S
    wait_for(lambda: pool.stats.crashed == crashed + 1, 30, "the exit to count as a crash")
    assert _served_normally(runner) != first


def test_health_reports_the_engine_loop(runner):
    pool = runner.gateway.pools[MODEL]
    wait_for(lambda: len(pool.ready()) == 1, 240, "a ready worker")
    worker = pool.ready()[0]
    health = runner.call(worker.probe_health())
    assert health.serving and health.engine_alive
    assert health.step_running_s < STUCK_AFTER_S
