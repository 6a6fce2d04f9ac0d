"""Gateway fixtures: a real gateway on loopback with real worker processes (the default model).

Workers get a 64 MiB KV pool (1,456 tokens), one torch thread each, a tenant page quota of 0.5
(so TENANT_QUOTA_EXCEEDED is reachable) and the integrity drill on for tenant `drill`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from gateway.auth import ApiKeys
from gateway.runner import GatewayRunner
from gateway.supervisor import PoolConfig

MODEL = "smollm2"
KEYS = {"acme": "key-acme", "bob": "key-bob", "drill": "key-drill", "other": "key-other"}
KV_BYTES = 64 << 20
WORKER_ARGS = ("--tenant-page-quota", "0.5", "--fault-tenant", "drill")


def api_keys() -> ApiKeys:
    # `other` may use only a model that is not served here: PERMISSION_DENIED for MODEL.
    return ApiKeys.parse(",".join(f"{k}={t}" + (":nope" if t == "other" else "")
                                  for t, k in KEYS.items()))


def pool_config(**overrides: object) -> PoolConfig:
    base: dict[str, object] = dict(model_id=MODEL, kv_cache_bytes=KV_BYTES,
                                   worker_args=WORKER_ARGS, max_inflight=8, worker_threads=1)
    base.update(overrides)
    return PoolConfig(**base)  # type: ignore[arg-type]


def start_runner(**overrides: object) -> GatewayRunner:
    return GatewayRunner([pool_config(**overrides)], api_keys()).start()


def worker_statuses(runner: GatewayRunner) -> list:
    """Status of every ready worker of the pool, read over its unix socket."""
    import asyncio

    from gateway._proto.tessera.v1 import worker_pb2 as wpb

    pool = runner.gateway.pools[MODEL]

    async def read() -> list:
        return list(await asyncio.gather(*(w.stub.Status(wpb.StatusRequest(), timeout=10)
                                           for w in pool.ready())))

    return runner.call(read())


def requests_drained(runner: GatewayRunner) -> bool:
    """No request running or waiting in any worker; every page free or only cached."""
    return all(s.num_running == 0 and s.num_waiting == 0
               and s.num_free_pages + s.prefix_cache.evictable_pages == s.num_pages
               for s in worker_statuses(runner))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def two_workers() -> Iterator[GatewayRunner]:
    """A gateway with a pool of exactly two workers (restarted if one dies), shared by the
    end-to-end, error, tenant-limit and worker-loss tests (which run last: they kill workers)."""
    runner = start_runner(min_workers=2, max_workers=2)
    yield runner
    runner.stop()
