"""REST fixtures: one real gateway with one real worker process (the default model, served as a
Workers-AI-style name with slashes) and the shim on the gateway's event loop, on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from gateway.rest import GatewayView, RestServer
from gateway.serve import GatewayRunner
from tests.gateway.conftest import KEYS, api_keys, pool_config

MODEL = "@cf/tessera/smollm2-135m"
BODY_LIMIT = 64 << 10
__all__ = ["KEYS", "MODEL", "Shim"]


@dataclass
class Shim:
    runner: GatewayRunner
    server: RestServer

    @property
    def url(self) -> str:
        return self.server.url

    def headers(self, tenant: str = "acme", **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {KEYS[tenant]}", **extra}


@pytest.fixture(scope="session")
def shim() -> Iterator[Shim]:
    config = pool_config(model_id=MODEL, min_workers=1, max_workers=1)
    runner = GatewayRunner([config], api_keys()).start()
    assert runner.gateway is not None
    server = RestServer(runner.target, port=0, view=GatewayView(runner.gateway, runner.loop),
                        max_body_bytes=BODY_LIMIT)
    runner.call(server.start())
    yield Shim(runner, server)
    runner.call(server.stop())
    runner.stop()
