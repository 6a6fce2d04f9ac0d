"""A request that arrives while the pool's template is still loading (the gateway listens
before it has finished): it waits, bounded by its deadline, for the first worker forked from
it and is served by that worker; past its deadline it ends DEADLINE_EXCEEDED and leaves nothing
behind (no queue ticket in the gateway, no request or page in the worker started for it)."""

from __future__ import annotations

import time

import pytest

from gateway.client import Client
from gateway.errors import DeadlineExceeded
from gateway.runner import GatewayRunner
from gateway.template import ForkedProcess
from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config, requests_drained, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


def _loading() -> GatewayRunner:
    runner = GatewayRunner([pool_config(min_workers=0, max_workers=1, idle_ttl_s=30)],
                           api_keys()).start(wait_ready=False)
    template = runner.gateway.pools[MODEL]._template
    assert template is not None and not template.ready.is_set()  # it loads for seconds
    return runner


def test_a_request_sent_while_the_template_loads_is_served_by_its_first_fork() -> None:
    runner = _loading()
    try:
        with Client(runner.target, api_key=KEYS["acme"]) as client:
            text = "".join(c.text for c in client.generate(PROMPT, max_tokens=4,
                                                           temperature=0.0, timeout_s=300))
        assert text.strip()
        pool = runner.gateway.pools[MODEL]
        assert [isinstance(w.process, ForkedProcess) for w in pool.ready()] == [True]
        assert pool._template.alive
    finally:
        runner.stop()


def test_a_deadline_passing_while_the_template_loads_leaves_nothing_behind() -> None:
    runner = _loading()
    pool = runner.gateway.pools[MODEL]
    try:
        started = time.monotonic()
        with Client(runner.target, api_key=KEYS["acme"]) as client, \
                pytest.raises(DeadlineExceeded):
            list(client.generate(PROMPT, max_tokens=8, temperature=0.0, timeout_s=0.5))
        assert time.monotonic() - started < 5  # not held until the template is up
        assert not pool._template.ready.is_set()  # it ended during the template's load
        wait_for(lambda: pool.waiting == 0, 10, "the request's queue ticket gone")
        wait_for(lambda: bool(pool.ready()), 300, "the worker woken for it ready")
        time.sleep(0.5)
        assert requests_drained(runner)
    finally:
        runner.stop()
