"""Worker processes per model: start them on demand (forked from the pool's template, or
spawned), wait for their pushed readiness, keep min/max, reap idle ones, recycle old ones by
draining, restart crashed ones with backoff, probe their health. Requests are admitted to the
pool's workers by gateway/admission.py; the configuration is gateway/pool_config.py."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Coroutine, Sequence
from typing import Any, cast

from gateway import metrics
from gateway.admission import Admission
from gateway.fairness import NO_LIMITS, FairQueue, TenantLimits
from gateway.logs import get_logger
from gateway.pool_config import PoolConfig, PoolStats
from gateway.readiness import ReadinessListener
from gateway.router import Router
from gateway.start_failures import StartFailures
from gateway.template import WorkerTemplate
from gateway.template_launch import LaunchedTemplate, pool_uses_template, template_command
from gateway.worker_command import threads_per_worker, worker_command, worker_env
from gateway.worker_handle import WorkerHandle

__all__ = ["PoolConfig", "PoolStats", "WorkerPool"]

log = get_logger("tessera.supervisor")


class WorkerPool:
    def __init__(self, config: PoolConfig, run_dir: str | None = None,
                 template: LaunchedTemplate | None = None) -> None:
        """`template`: this pool's template, already started (gateway/template_launch.py:
        launch_pool_template); None: the pool starts its own when it keeps one."""
        self.config = config
        self._launched_template = template
        self._own_run_dir = run_dir is None
        # made when the first worker starts: a pool that never starts one leaves no folder
        self._run_dir = run_dir
        self.router = Router()
        self.workers: dict[str, WorkerHandle] = {}
        self.stats = PoolStats()
        self.start_failures = StartFailures(config.pool_label, config.max_start_failures)
        self.admission = Admission(config.pool_label)
        self._seq = 0
        self._consecutive_crashes = 0
        self._next_spawn_at = 0.0
        self._closed = False
        self._maintainer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._template: WorkerTemplate | None = None
        self._readiness: ReadinessListener | None = None

    # -- admission (gateway/admission.py) ------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        if pool_uses_template(cfg):
            self._template = WorkerTemplate(template_command(cfg), worker_env(cfg),
                                            self._launched_template)
            self._background(self._template.start(cfg.start_timeout_s))
        elif self._launched_template is not None:
            self._launched_template.close()
        self._maintainer = asyncio.create_task(self._maintain())
        await self._ensure_min()

    def live(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.state in ("starting", "ready", "draining")]

    def ready(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.state == "ready"]

    @property
    def waiting(self) -> int:
        """Requests waiting for a worker slot, all tenants."""
        return self.admission.waiting

    @property
    def queue(self) -> FairQueue:
        """The pool's wait queue, fair between tenants."""
        return self.admission.queue

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_queue(self) -> int:
        return self.config.max_queue

    async def acquire(self, session: str | None = None, prefix_key: str | None = None,
                      timeout_s: float | None = None, *, tenant: str = "",
                      limits: TenantLimits = NO_LIMITS) -> WorkerHandle:
        """A worker with a free slot for one request of `tenant`; release() it, naming the same
        tenant, when the request ends. Waiting requests take freed slots in the FairQueue's
        order; past the tenant's own queue bound, or the pool's, a request is refused."""
        worker = await self.admission.admit(self, session, prefix_key, timeout_s,
                                            self.config.start_timeout_s, tenant, limits)
        return cast(WorkerHandle, worker)

    def check_startable(self) -> None:
        if self.start_failures.failed and not self.ready():
            self._scale_up()  # still retried, on its back-off
            raise self.start_failures.error()

    def take_slot(self, session: str | None, prefix_key: str | None) -> WorkerHandle | None:
        worker = self.router.pick(self.live(), session, prefix_key)
        if worker is None:
            return None
        worker = cast(WorkerHandle, worker)
        worker.inflight += 1
        worker.last_used = time.monotonic()
        return worker

    def wake(self) -> None:
        if not any(w.available for w in self.live()):  # not just a tenant's cap
            self._scale_up()

    async def release(self, worker: WorkerHandle, tenant: str = "") -> None:
        self.admission.finish(tenant)
        worker.inflight -= 1
        worker.requests_served += 1
        worker.last_used = time.monotonic()
        limit = self.config.recycle_after_requests
        if worker.state == "ready" and limit is not None and worker.requests_served >= limit:
            self._begin_drain(worker, "recycle")
        if worker.state == "draining" and worker.inflight == 0:
            self._background(self._retire(worker))
        if worker.id not in self.workers and worker.inflight == 0:
            await worker.close_channel()
        await self._notify()

    async def report_lost(self, worker: WorkerHandle) -> None:
        """A call to this worker failed as UNAVAILABLE: unless it still answers a health probe,
        take it out of routing now (before its exit is noticed) and make sure it is gone."""
        if worker.state not in ("ready", "draining") or await worker.answers_health():
            return
        await self._declare_lost(worker, "unresponsive")

    async def _declare_lost(self, worker: WorkerHandle, cause: str) -> None:
        """Out of routing, killed: its in-flight calls fail as UNAVAILABLE (WORKER_LOST, retried
        before the first token) and its exit is handled as a crash, so it is replaced."""
        if worker.state not in ("ready", "draining"):
            return
        log.warning("worker lost", worker=worker.id, cause=cause, inflight=worker.inflight)
        metrics.WORKERS_LOST.labels(self.config.pool_label, cause).inc()
        worker.state = "lost"
        worker.kill()
        await self._notify()

    async def check_health(self) -> None:
        """Probe every serving worker's engine loop (the probe never waits on the loop)."""
        workers = [w for w in self.workers.values() if w.state in ("ready", "draining")]
        probes = await asyncio.gather(*(w.probe_health() for w in workers))
        for w, health in zip(workers, probes, strict=True):
            if health is None:
                w.missed_health += 1
                if w.missed_health >= self.config.max_missed_health:
                    await self._declare_lost(w, "unresponsive")
                continue
            w.missed_health = 0
            if not health.engine_alive:
                await self._declare_lost(w, "engine_dead")
            elif health.step_running_s > self.config.stuck_after_s:
                await self._declare_lost(w, "engine_stuck")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify(self) -> None:
        await self.admission.notify()

    # -- lifecycle ----------------------------------------------------------------------------

    def _scale_up(self) -> None:
        live = self.live()
        starting = sum(1 for w in live if w.state == "starting")
        if (len(live) < self.config.max_workers and starting == 0
                and time.monotonic() >= self._next_spawn_at and not self._closed):
            self._spawn()

    def _spawn(self) -> WorkerHandle:
        self._seq += 1
        wid = f"{self.config.pool_label.replace('/', '-')}-{self._seq}"
        if self._run_dir is None:
            self._run_dir = tempfile.mkdtemp(prefix="tessera-")
        if self._readiness is None:
            self._readiness = ReadinessListener(os.path.join(self._run_dir, "ready.sock"))
        worker = WorkerHandle(wid, os.path.join(self._run_dir, f"w{self._seq}.sock"),
                              self.config.max_inflight)
        self.workers[wid] = worker
        self.stats.spawned += 1
        self._background(self._run(worker))
        return worker

    @property
    def threads_per_worker(self) -> int:
        return threads_per_worker(self.config)

    def _command(self, worker: WorkerHandle) -> list[str]:
        ready = None if self._readiness is None else self._readiness.path
        return worker_command(self.config, worker.id, worker.socket_path, ready)

    async def _run(self, worker: WorkerHandle) -> None:
        """Start one worker, wait for health, then watch it until it exits."""
        start = None if self._template is None else self._template.start_worker
        assert self._readiness is not None
        ready = self._readiness.expect(worker.id)
        try:
            await worker.launch(self._command(worker), worker_env(self.config),
                                self.config.start_timeout_s, ready, start)
        except Exception as e:
            if worker.state == "starting":  # not stopped by a drain or close meanwhile
                await self._start_failed(worker, str(e))
        finally:
            self._readiness.forget(worker.id)
        if worker.state == "ready":
            self.start_failures.record_ready()
            self.stats.cold_starts_s.append(worker.cold_start_s)
            metrics.COLD_START.labels(self.config.pool_label).observe(worker.cold_start_s)
            self._consecutive_crashes = 0
            log.info("worker ready", worker=worker.id, pid=worker.pid,
                     cold_start_s=round(worker.cold_start_s, 3))
        await self._notify()
        code = await worker.wait_exit()
        if worker.state != "stopped":  # nobody asked it to exit
            self._on_crash(worker, code)
        self.workers.pop(worker.id, None)
        metrics.forget_worker(self.config.pool_label, worker.id)
        if worker.inflight == 0:
            await worker.close_channel()
        self._update_gauges()
        await self._notify()

    async def _start_failed(self, worker: WorkerHandle, error: str) -> None:
        cause = await worker.stderr.error_line() or error
        log.warning("worker failed to start", worker=worker.id, error=error, cause=cause)
        if self.start_failures.record_failure(cause):
            log.error("pool failed: its workers cannot start; still retrying",
                      model=self.config.pool_label, tries=self.start_failures.consecutive,
                      cause=cause)

    def _on_crash(self, worker: WorkerHandle, code: int | None) -> None:
        if worker.state != "lost":  # not replaced by the supervisor: it exited on its own
            metrics.WORKERS_LOST.labels(self.config.pool_label, "exited").inc()
        worker.state = "stopped"
        self.stats.crashed += 1
        self._consecutive_crashes += 1
        backoff = min(self.config.restart_backoff_s * 2 ** (self._consecutive_crashes - 1),
                      self.config.max_restart_backoff_s)
        self._next_spawn_at = time.monotonic() + backoff
        log.warning("worker exited unexpectedly", worker=worker.id, exit_code=code,
                    restart_in_s=backoff, inflight=worker.inflight)

    def _begin_drain(self, worker: WorkerHandle, why: str) -> None:
        worker.state = "draining"
        if why == "recycle":
            self.stats.recycled += 1
        log.info("draining worker", worker=worker.id, why=why,
                 requests_served=worker.requests_served)

    async def _retire(self, worker: WorkerHandle) -> None:
        worker.state = "stopped"
        await worker.terminate()
        await self._ensure_min()

    async def _ensure_min(self) -> None:
        while (len(self.live()) < self.config.min_workers and not self._closed
               and time.monotonic() >= self._next_spawn_at):
            self._spawn()

    async def _poll_status(self) -> None:
        """Refresh each ready worker's status (pages, load, integrity): metrics, ListModels."""
        for w in self.ready():
            status = await w.read_status()
            if status is not None:
                metrics.record_worker_status(self.config.pool_label, status)

    async def _maintain(self, period_s: float = 0.25, status_every: int = 8,
                        health_every: int = 4) -> None:
        for tick in itertools.count():
            if self._closed:
                return
            await asyncio.sleep(period_s)
            try:
                if tick % health_every == 0:
                    await self.check_health()
                if tick % status_every == 0:
                    await self._poll_status()
                await self.tick()
            except Exception:  # a failed pass must not end maintenance for good
                log.exception("pool maintenance failed", model=self.config.model_id)

    async def tick(self, now: float | None = None) -> None:
        """One maintenance pass: reap idle workers above the minimum, recycle old ones,
        retire drained ones, start workers up to the minimum."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        for w in self.ready():
            idle = w.inflight == 0 and now - w.last_used >= (cfg.idle_ttl_s or float("inf"))
            if idle and len(self.live()) > cfg.min_workers:
                self.stats.reaped += 1
                self._begin_drain(w, "idle")
            elif cfg.recycle_after_s is not None and now - w.ready_at >= cfg.recycle_after_s:
                self._begin_drain(w, "recycle")
            if w.state == "draining" and w.inflight == 0:
                await self._retire(w)
        await self._ensure_min()
        self._update_gauges()

    def _update_gauges(self) -> None:
        for state in ("starting", "ready", "draining"):
            n = sum(1 for w in self.workers.values() if w.state == state)
            metrics.WORKERS.labels(self.config.pool_label, state).set(n)

    async def close(self) -> None:
        self._closed = True
        if self._maintainer is not None:
            self._maintainer.cancel()
        workers: Sequence[WorkerHandle] = list(self.workers.values())
        for w in workers:
            w.state = "stopped"
        await asyncio.gather(*(w.terminate() for w in workers), return_exceptions=True)
        if self._template is not None:
            await self._template.close()
        elif self._launched_template is not None:
            self._launched_template.close()  # NOTE: never started: nothing adopted it
        await self._notify()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        if self._readiness is not None:
            self._readiness.close()
        if self._own_run_dir and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
