"""REST fixtures: one real gateway with one real worker process (the default model, served as a
Workers-AI-style name with slashes) and the shim on the gateway's event loop, on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.rest import GatewayView, RestServer
from gateway.runner import GatewayRunner
from tests.gateway.conftest import KEYS, api_keys, pool_config
from tests.rest.browser import Browser, find_or_install_chromium

MODEL = "@cf/tessera/smollm2-135m"
BODY_LIMIT = 64 << 10
OPERATOR_KEY = "operator-key-for-tests"
__all__ = ["KEYS", "MODEL", "OPERATOR_KEY", "Shim"]


@dataclass
class Shim:
    runner: GatewayRunner
    server: RestServer

    @property
    def url(self) -> str:
        return self.server.url

    def headers(self, tenant: str = "acme", **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {KEYS[tenant]}", **extra}

    def worker_statuses(self) -> list[Any]:
        """Status of every ready worker, read over its unix socket."""
        from gateway._proto.tessera.v1 import worker_pb2 as wpb

        async def read() -> list[Any]:
            workers = self.runner.gateway.pools[MODEL].ready()
            return list(await asyncio.gather(*(w.stub.Status(wpb.StatusRequest(), timeout=10)
                                               for w in workers)))

        return self.runner.call(read())

    def num_running(self) -> int:
        return sum(s.num_running for s in self.worker_statuses())

    def workers_idle(self) -> bool:
        """No request running or waiting in any worker; every page free or only cached."""
        return all(s.num_running == 0 and s.num_waiting == 0
                   and s.num_free_pages + s.prefix_cache.evictable_pages == s.num_pages
                   for s in self.worker_statuses())

    @contextmanager
    def only_slot_taken(self, max_queue: int) -> Iterator[None]:
        """The only worker takes one request at a time and is busy with a long one; the
        gateway queues up to `max_queue` more. Restored afterwards."""
        from dataclasses import replace

        from gateway.client import NO_RETRY, Client

        pool = self.runner.gateway.pools[MODEL]
        config = pool.config
        pool.config = replace(config, max_queue=max_queue)
        for w in pool.ready():
            w.max_inflight = 1
        holder = Client(self.runner.target, api_key=KEYS["bob"], retry=NO_RETRY)
        stream = holder.generate("Count:", model=MODEL, max_tokens=600, ignore_eos=True)
        try:
            next(iter(stream))
            yield
        finally:
            stream.cancel()
            holder.close()
            pool.config = config
            for w in pool.workers.values():
                w.max_inflight = config.max_inflight

    @contextmanager
    def another_server(self, **options: Any) -> Iterator[RestServer]:
        """A second shim on the same gateway (no new worker), stopped at the end if the test
        has not stopped it."""
        server = RestServer(self.runner.target, port=0, operator_key=OPERATOR_KEY, **options)
        self.runner.call(server.start())
        try:
            yield server
        finally:
            if not server.drain.draining:
                self.runner.call(server.stop(grace_s=0))


@pytest.fixture(scope="session")
def shim() -> Iterator[Shim]:
    config = pool_config(model_id=MODEL, min_workers=1, max_workers=1)
    runner = GatewayRunner([config], api_keys()).start()
    assert runner.gateway is not None
    server = RestServer(runner.target, port=0, view=GatewayView(runner.gateway, runner.loop),
                        max_body_bytes=BODY_LIMIT, operator_key=OPERATOR_KEY)
    runner.call(server.start())
    yield Shim(runner, server)
    runner.call(server.stop())
    runner.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Debian chromium, one fresh profile per test module."""
    binary = find_or_install_chromium()
    if binary is None:
        pytest.skip("Debian's chromium is not installed and `apt-get install chromium` failed")
    b = Browser(binary)
    yield b
    b.close()
