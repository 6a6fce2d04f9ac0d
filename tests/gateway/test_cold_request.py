"""A request that arrives at a pool scaled to zero: served by the worker it wakes (forked from
the template); cancelled, or past its deadline, while that worker starts, it leaves nothing
behind: no queued ticket in the gateway, no request or page in the worker once it is up."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.template import ForkedProcess
from tests.gateway.conftest import (
    KEYS,
    MODEL,
    api_keys,
    pool_config,
    requests_drained,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def at_zero() -> Iterator[GatewayRunner]:
    runner = GatewayRunner([pool_config(min_workers=0, max_workers=1, idle_ttl_s=0.5)],
                           api_keys()).start(wait_ready=False)
    template = runner.gateway.pools[MODEL]._template
    assert template is not None  # on by default for a pool that scales from zero
    runner.call(template.ready.wait(), timeout_s=300)
    yield runner
    runner.stop()


def _pool(runner: GatewayRunner):
    return runner.gateway.pools[MODEL]


def _to_zero(runner: GatewayRunner) -> None:
    wait_for(lambda: not _pool(runner).live(), 60, "the pool at zero")


def test_the_request_that_arrives_at_zero_is_served(at_zero: GatewayRunner) -> None:
    _to_zero(at_zero)
    with Client(at_zero.target, api_key=KEYS["acme"]) as client:
        stream = client.generate(PROMPT, max_tokens=4, temperature=0.0)
        text = "".join(c.text for c in stream)
    assert text.strip()
    assert isinstance(_pool(at_zero).ready()[0].process, ForkedProcess)


def test_a_cancel_during_the_cold_start_leaves_nothing_behind(at_zero: GatewayRunner,
                                                               monkeypatch) -> None:
    _to_zero(at_zero)
    pool = _pool(at_zero)
    # NOTE: a fork from the warm template is ready in ~50 ms on a quiet machine, too short a
    # window to cancel inside reliably: the fork waits 1 s first, as on a loaded host
    fork = pool._template.fork

    async def slow_fork(command: list[str]):
        await asyncio.sleep(1.0)
        return await fork(command)

    monkeypatch.setattr(pool._template, "fork", slow_fork)
    errors: list[BaseException] = []
    with Client(at_zero.target, api_key=KEYS["acme"]) as client:
        stream = client.generate(PROMPT, max_tokens=64, temperature=0.0)

        def consume() -> None:
            try:
                list(stream)
            except BaseException as e:  # the cancellation, as the client sees it
                errors.append(e)

        reader = threading.Thread(target=consume)
        reader.start()
        wait_for(lambda: any(w.state == "starting" for w in pool.live()), 30,
                 "a worker starting for the request")
        stream.cancel()
        reader.join(30)
    assert not reader.is_alive()  # the stream ended (with the cancellation, if it raised)
    assert all("cancel" in str(e).lower() for e in errors), errors
    wait_for(lambda: pool.waiting == 0, 10, "the request's queue ticket gone")
    # the woken worker finishes its start, or is stopped for want of demand: either way none
    # stays starting, and whatever runs holds no request and no page
    wait_for(lambda: not any(w.state == "starting" for w in pool.live()), 60,
             "the woken worker ready or stopped")
    time.sleep(0.5)
    assert requests_drained(at_zero)
    monkeypatch.undo()
    with Client(at_zero.target, api_key=KEYS["acme"]) as client:  # and the next is served
        assert "".join(c.text for c in client.generate(PROMPT, max_tokens=4)).strip()


def test_a_deadline_during_the_cold_start_leaves_nothing_behind(
        at_zero: GatewayRunner) -> None:
    _to_zero(at_zero)
    pool = _pool(at_zero)
    with Client(at_zero.target, api_key=KEYS["acme"]) as client, \
            pytest.raises(Exception, match=r"(?i)deadline"):
        list(client.generate(PROMPT, max_tokens=64, temperature=0.0, timeout_s=0.05))
    wait_for(lambda: pool.waiting == 0, 10, "the request's queue ticket gone")
    if pool.live():  # the request reached the pool in time to wake a worker
        wait_for(lambda: bool(pool.ready()), 60, "the woken worker ready")
        time.sleep(0.5)
        assert requests_drained(at_zero)
