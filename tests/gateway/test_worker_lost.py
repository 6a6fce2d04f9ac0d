"""A worker dies with requests on it: the streaming one ends with WORKER_LOST (its tokens
stay valid), the one with no token yet is retried on the other worker, the session moves
once, the supervisor restarts the dead worker, and the gateway keeps serving.

Runs last on the shared two-worker gateway: it kills one of its workers."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace

import pytest

from gateway.client import NO_RETRY, Client, WorkerLost
from tests.gateway.conftest import KEYS, MODEL, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SESSION = "session-on-the-doomed-worker"


@pytest.fixture(scope="module")
def aftermath(two_workers):
    """Freeze the session's worker, queue a second request on it, then kill it."""
    pool = two_workers.gateway.pools[MODEL]
    crashed_before = pool.stats.crashed
    client = Client(two_workers.target, api_key=KEYS["acme"], retry=NO_RETRY)
    probe = client.generate("Hi", max_tokens=1, session=SESSION)
    list(probe)
    doomed = pool.workers[probe.served.worker_id]
    streaming = client.generate("Count:", max_tokens=600, ignore_eos=True, session=SESSION)
    chunks = iter(streaming)
    sent_before = [next(chunks).token_ids for _ in range(2)]
    # NOTE: the health probe would replace a frozen worker after a few missed probes; this
    # scenario wants the SIGKILL below to be what ends it, however slow the machine is.
    config = pool.config
    pool.config = replace(config, max_missed_health=10_000)
    os.kill(doomed.pid, signal.SIGSTOP)  # no more tokens from it, nothing noticed yet
    waiting = client.generate("The capital of France is", max_tokens=6, temperature=0.0,
                              session=SESSION)
    waiting_out: list = []
    thread = threading.Thread(target=lambda: waiting_out.append(list(waiting)))
    thread.start()
    wait_for(lambda: doomed.inflight == 2, 30, "the second request to reach the worker")
    os.kill(doomed.pid, signal.SIGKILL)
    with pytest.raises(WorkerLost) as lost:
        for chunk in chunks:
            sent_before.append(chunk.token_ids)
    thread.join(60)
    pool.config = config
    yield dict(pool=pool, doomed=doomed, streaming=streaming, lost=lost.value,
               sent_before=sent_before, waiting=waiting, waiting_out=waiting_out,
               client=client, crashed_before=crashed_before)
    client.close()


def test_stream_on_a_killed_worker_ends_with_worker_lost_and_keeps_its_tokens(aftermath):
    assert aftermath["lost"].reason == "WORKER_LOST"
    streaming = aftermath["streaming"]
    assert streaming.token_ids == [t for ids in aftermath["sent_before"] for t in ids]
    assert len(streaming.token_ids) >= 2 and streaming.usage is None


def test_request_without_tokens_is_retried_on_another_worker(aftermath):
    waiting = aftermath["waiting"]
    assert aftermath["waiting_out"], "the queued request did not finish"
    assert waiting.attempts == 1, "the gateway, not the client, retried it"
    assert waiting.served.worker_id != aftermath["doomed"].id
    assert waiting.text.startswith(" Paris")


def test_gateway_keeps_serving_and_the_session_moves_once(aftermath, two_workers):
    pool, client = aftermath["pool"], aftermath["client"]
    new_home = aftermath["waiting"].served.worker_id
    stream = client.generate("Hello", max_tokens=2, session=SESSION)
    list(stream)
    assert stream.served.worker_id == new_home
    wait_for(lambda: len(pool.ready()) == 2, 120, "a replacement worker")
    replacement = {w.id for w in pool.ready()} - {new_home}
    assert replacement and aftermath["doomed"].id not in replacement
    for _ in range(4):  # the replacement does not pull the session back
        stream = client.generate("Hello", max_tokens=1, session=SESSION)
        list(stream)
        assert stream.served.worker_id == new_home


def test_crashed_worker_is_counted_and_restarted(aftermath):
    pool, doomed = aftermath["pool"], aftermath["doomed"]
    assert pool.stats.crashed == aftermath["crashed_before"] + 1
    assert doomed.process.returncode == -signal.SIGKILL
    assert doomed.id not in pool.workers
    wait_for(lambda: len(pool.ready()) == 2, 120, "a replacement worker")
