"""A fresh machine: the real stack started with an empty torch-extensions cache. The worker
builds its C++ ops and runs a warm-up step before it is ever declared ready, so the first
request pays no build and finds an engine thread alive."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import Client
from gateway.runner import GatewayRunner
from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_first_answer_on_an_empty_extension_cache(tmp_path: Path) -> None:
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    config = pool_config(min_workers=1, max_workers=1, start_timeout_s=600,
                         worker_threads=1,
                         worker_env=(("TORCH_EXTENSIONS_DIR", str(cache)),))
    started = time.monotonic()
    runner = GatewayRunner([config], api_keys()).start(wait_ready=False)
    try:
        pool = runner.gateway.pools[MODEL]
        # Until ready, nothing may be routed: the worker's socket does not exist yet, and the
        # gateway's own health check tells a readiness probe to hold traffic back.
        assert pool.ready() == []
        assert _gateway_health(runner) == health_pb2.HealthCheckResponse.NOT_SERVING
        runner.call(runner.wait_ready(timeout_s=600), timeout_s=660)
        time.sleep(1.0)  # the health status follows the pool within half a second
        assert _gateway_health(runner) == health_pb2.HealthCheckResponse.SERVING
        worker = pool.ready()[0]
        assert worker.status is not None
        assert worker.status.native_ops == "loaded"  # as read when it was declared ready
        assert any(cache.rglob("*.so")), "the build went somewhere else"
        with Client(runner.target, api_key=KEYS["acme"]) as client:
            stream = client.generate("The capital of France is", max_tokens=8,
                                     temperature=0.0)
            text = "".join(c.text for c in stream)
        assert text.strip() and stream.finish_reason in ("length", "stop")
        health = runner.call(worker.probe_health())
        assert health.engine_alive
        print(f"cold cache: ready after {worker.cold_start_s:.1f} s, first answer "
              f"{time.monotonic() - started:.1f} s after start")
    finally:
        runner.stop()


def _gateway_health(runner: GatewayRunner) -> int:
    with grpc.insecure_channel(runner.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
