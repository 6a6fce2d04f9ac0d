"""Worker lifecycle with real processes: scale from zero with a measured cold start, recycle
after N requests by draining, reap an idle worker back to zero."""

from __future__ import annotations

import pytest

from gateway.client import Client
from tests.gateway.conftest import KEYS, MODEL, start_runner, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
RECYCLE_AFTER = 3
IDLE_TTL_S = 4.0


@pytest.fixture(scope="module")
def elastic():
    """A pool that starts empty, holds at most one worker, recycles it after three requests
    and reaps it after four idle seconds."""
    runner = start_runner(min_workers=0, max_workers=1, idle_ttl_s=IDLE_TTL_S,
                          recycle_after_requests=RECYCLE_AFTER)
    client = Client(runner.target, api_key=KEYS["acme"])
    yield runner, runner.gateway.pools[MODEL], client
    client.close()
    runner.stop()


def served_by(client: Client) -> str:
    stream = client.generate("Hi", max_tokens=2)
    list(stream)
    return stream.served.worker_id


def test_first_request_starts_a_worker_and_measures_its_cold_start(elastic):
    _, pool, client = elastic
    assert not pool.workers, "a pool with min_workers=0 starts empty"
    served_by(client)
    assert pool.stats.spawned == 1
    [cold_start_s] = pool.stats.cold_starts_s
    assert 0 < cold_start_s < 180


def test_worker_is_recycled_after_n_requests_by_draining(elastic):
    _, pool, client = elastic
    first = {served_by(client) for _ in range(RECYCLE_AFTER - 1)}
    assert len(first) == 1
    [old_id] = first
    wait_for(lambda: old_id not in pool.workers, 30, "the recycled worker to exit")
    assert pool.stats.recycled == 1 and pool.stats.crashed == 0
    assert served_by(client) != old_id
    assert pool.stats.spawned == 2


def test_idle_worker_is_reaped_to_zero(elastic):
    _, pool, _ = elastic
    [worker] = pool.workers.values()
    wait_for(lambda: not pool.workers, IDLE_TTL_S + 30, "the idle worker to be reaped")
    assert pool.stats.reaped == 1 and pool.stats.crashed == 0
    assert worker.process.returncode == 0, "a reaped worker exits cleanly after SIGTERM"
