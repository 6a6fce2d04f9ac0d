"""The gateway and its worker supervisor on a background event loop of their own: what
`tessera serve` runs, and what tests and benchmarks start in-process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from gateway.auth import ApiKeys
from gateway.fairness import NO_LIMITS, TenantLimits
from gateway.grpc_server import Gateway, build_server
from gateway.logs import configure, get_logger
from gateway.supervisor import PoolConfig, WorkerPool
from gateway.template_launch import LaunchedTemplate

log = get_logger("tessera.runner")


class GatewayRunner:
    """The gateway on its own event loop thread; `call` runs a coroutine there."""

    def __init__(self, pools: Sequence[PoolConfig], keys: ApiKeys, host: str = "127.0.0.1",
                 port: int = 0, tenant_limits: TenantLimits = NO_LIMITS,
                 templates: Mapping[str, LaunchedTemplate] | None = None) -> None:
        """`templates`: pools' templates already started, by pool label (`tessera serve`
        starts them before the gateway, gateway/template_launch.py); any other pool that keeps
        one starts its own."""
        self.pool_configs, self.keys, self.host, self.port = list(pools), keys, host, port
        self.templates = dict(templates or {})
        self.tenant_limits = tenant_limits
        self.loop = asyncio.new_event_loop()
        self.gateway: Gateway | None = None
        self._server: Any = None
        self._health_task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="tessera-gateway",
                                        daemon=True)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, wait_ready: bool = True) -> GatewayRunner:
        configure()
        self._thread.start()
        self.call(self._start(wait_ready))
        return self

    async def _start(self, wait_ready: bool) -> None:
        def pool(c: PoolConfig) -> WorkerPool:
            return WorkerPool(c, template=self.templates.pop(c.pool_label, None))

        pools = {c.model_id: pool(c) for c in self.pool_configs if c.role != "prefill"}
        prefill = {c.model_id: pool(c) for c in self.pool_configs if c.role == "prefill"}
        self.gateway = Gateway(pools, self.keys, tenant_limits=self.tenant_limits,
                               prefill_pools=prefill)
        self._server, self.port = await build_server(self.gateway, self.host, self.port)
        await self._server.start()
        for pool in self._all_pools():
            await pool.start()
        self._health_task = asyncio.create_task(self._follow_health())
        if wait_ready:
            await self.wait_ready()

    async def _follow_health(self, period_s: float = 0.5) -> None:
        """Keep grpc.health.v1 in step with the pools (workers ready, draining)."""
        assert self.gateway is not None
        while True:
            try:
                await self.gateway.refresh_health()
            except Exception:  # a failed refresh must not end the watch
                log.exception("health refresh failed")
            await asyncio.sleep(period_s)

    async def wait_ready(self, timeout_s: float = 300) -> None:
        """Until every pool has its minimum of ready workers."""
        assert self.gateway is not None
        deadline = self.loop.time() + timeout_s
        while any(len(p.ready()) < p.config.min_workers for p in self._all_pools()):
            if self.loop.time() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s} s")
            await asyncio.sleep(0.1)

    def stop(self, grace_s: float = 0.0) -> None:
        """Drain (new requests get UNAVAILABLE; in-flight ones have grace_s to finish, then
        end with UNAVAILABLE), stop the server, stop every worker."""
        for template in self.templates.values():  # no pool of theirs was made
            template.close()
        self.templates.clear()
        if not self._thread.is_alive():
            return
        try:
            self.call(self._stop(grace_s), timeout_s=grace_s + 60)
        except concurrent.futures.TimeoutError:
            log.warning("gateway did not stop in time")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    async def drain(self, grace_s: float) -> None:
        if self.gateway is not None:
            await self.gateway.drain(grace_s)

    async def _stop(self, grace_s: float) -> None:
        await self.drain(grace_s)
        if self._health_task is not None:
            self._health_task.cancel()
        if self._server is not None:
            await self._server.stop(grace=1)
        if self.gateway is not None:
            await asyncio.gather(*(p.close() for p in self._all_pools()))

    def _all_pools(self) -> list[WorkerPool]:
        """Colocated and decode pools, then prefill pools."""
        if self.gateway is None:
            return []
        return [*self.gateway.pools.values(), *self.gateway.prefill_pools.values()]

    def __enter__(self) -> GatewayRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
