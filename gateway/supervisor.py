"""Worker processes per model: spawn on demand, wait for health, keep min/max, reap idle ones,
recycle old ones by draining, restart crashed ones with backoff. Each pool admits requests
through a bounded queue, fair between tenants (gateway.fairness); past a tenant's bound,
TENANT_CONCURRENCY_EXCEEDED, past the pool's, OVERLOADED, both with a retry hint."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gateway import metrics
from gateway.errors import DeadlineExceeded, Overloaded, TenantConcurrencyExceeded, WorkerLost
from gateway.fairness import NO_LIMITS, FairQueue, TenantLimits, Ticket
from gateway.logs import get_logger
from gateway.readiness import ReadinessListener
from gateway.router import Router
from gateway.start_failures import StartFailures
from gateway.template import WorkerTemplate, uses_template
from gateway.worker_handle import WorkerHandle
from runtime.errors import InvalidArgument
from runtime.threads import share_of_cores, thread_env

log = get_logger("tessera.supervisor")
# The checkout holding runtime/ and gateway/: workers import from it whatever their cwd.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class PoolConfig:
    model_id: str
    model_path: str | None = None  # None: the embedded default model
    min_workers: int = 1
    max_workers: int = 2
    max_inflight: int = 16  # per worker
    max_queue: int = 64  # requests waiting for a worker, per pool
    kv_cache_bytes: int | None = None  # None: each worker sizes its pool from free memory
    idle_ttl_s: float | None = None  # reap workers idle this long, down to min_workers
    recycle_after_requests: int | None = None
    recycle_after_s: float | None = None
    start_timeout_s: float = 180.0
    # A worker whose engine loop died, whose current step has run this long, or that missed
    # this many health probes in a row, is treated as crashed and replaced.
    stuck_after_s: float = 60.0
    max_missed_health: int = 3
    restart_backoff_s: float = 0.5
    max_restart_backoff_s: float = 30.0
    # this many failed starts in a row fail the pool: requests get WORKER_START_FAILED at once
    # (gateway/start_failures.py) while starts are still retried on the back-off above
    max_start_failures: int = 3
    worker_args: tuple[str, ...] = ()
    worker_env: tuple[tuple[str, str], ...] = ()
    # CPU threads per worker; None: this host's cores split evenly among max_workers
    worker_threads: int | None = None
    # "both": colocated workers; "prefill" / "decode": one pool of disaggregated serving, its
    # formats in worker_args (gateway/transfer.py). A decode pool bounds each KV transfer.
    role: str = "both"
    transfer_timeout_s: float = 60.0
    # fork workers from a template process (gateway/template.py); None: when the pool scales
    # from zero or can grow
    template: bool | None = None

    @property
    def pool_label(self) -> str:
        """The pool's name in metrics and worker ids: the model id, plus the role if any."""
        return self.model_id if self.role == "both" else f"{self.model_id}/{self.role}"

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode") or self.transfer_timeout_s <= 0:
            raise InvalidArgument("role must be both, prefill or decode, and "
                                  "transfer_timeout_s > 0", field="role")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise InvalidArgument("need 0 <= min_workers <= max_workers, max_workers >= 1",
                                  field="min_workers")
        if self.stuck_after_s <= 0 or self.max_missed_health < 1:
            raise InvalidArgument("stuck_after_s must be > 0 and max_missed_health >= 1",
                                  field="stuck_after_s")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise InvalidArgument("worker_threads must be >= 1", field="worker_threads")
        if self.max_start_failures < 1 or self.max_restart_backoff_s < self.restart_backoff_s:
            raise InvalidArgument("max_start_failures must be >= 1 and max_restart_backoff_s "
                                  ">= restart_backoff_s", field="max_start_failures")
        if self.max_inflight < 1 or self.max_queue < 0:
            raise InvalidArgument("max_inflight must be >= 1 and max_queue >= 0",
                                  field="max_inflight")


@dataclass
class PoolStats:
    spawned: int = 0
    crashed: int = 0
    reaped: int = 0
    recycled: int = 0
    cold_starts_s: list[float] = field(default_factory=list)


class WorkerPool:
    def __init__(self, config: PoolConfig, run_dir: str | None = None) -> None:
        self.config = config
        self._own_run_dir = run_dir is None
        # made when the first worker starts: a pool that never starts one leaves no folder
        self._run_dir = run_dir
        self.router = Router()
        self.workers: dict[str, WorkerHandle] = {}
        self.stats = PoolStats()
        self.start_failures = StartFailures(config.pool_label, config.max_start_failures)
        self.waiting = 0  # requests that could not start at once, all tenants
        self.queue = FairQueue()
        self._changed = asyncio.Condition()
        self._seq = 0
        self._consecutive_crashes = 0
        self._next_spawn_at = 0.0
        self._closed = False
        self._maintainer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._template: WorkerTemplate | None = None
        self._readiness: ReadinessListener | None = None

    # -- admission ----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        if uses_template(cfg.template, cfg.min_workers, cfg.max_workers):
            shape = WorkerHandle(f"{cfg.pool_label}-template", "", cfg.max_inflight)
            self._template = WorkerTemplate(self._command(shape), self._worker_env())
            self._background(self._template.start(cfg.start_timeout_s))
        self._maintainer = asyncio.create_task(self._maintain())
        await self._ensure_min()

    def live(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.state in ("starting", "ready", "draining")]

    def ready(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.state == "ready"]

    async def acquire(self, session: str | None = None, prefix_key: str | None = None,
                      timeout_s: float | None = None, *, tenant: str = "",
                      limits: TenantLimits = NO_LIMITS) -> WorkerHandle:
        """A worker with a free slot for one request of `tenant`; release() it, naming the same
        tenant, when the request ends. Waiting requests take freed slots in the FairQueue's
        order; past the tenant's own queue bound, or the pool's, a request is refused."""
        wait_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        model = self.config.pool_label
        async with self._changed:
            ticket = self.queue.join(tenant, limits)
            started = queued = False
            try:
                while True:
                    if self.start_failures.failed and not self.ready():
                        self._scale_up()  # still retried, on its back-off
                        raise self.start_failures.error()
                    if self.queue.next_up() is ticket:
                        worker = self.router.pick(self.live(), session, prefix_key)
                        if worker is not None:
                            worker = cast(WorkerHandle, worker)
                            worker.inflight += 1
                            worker.last_used = time.monotonic()
                            self.queue.start(ticket)
                            started = True
                            # NOTE: another slot may be free for whoever's turn is next.
                            self._changed.notify_all()
                            return worker
                    if not any(w.available for w in self.live()):  # not just a tenant's cap
                        self._scale_up()
                    if not queued:
                        self._check_room(ticket)
                        queued = True
                        self.waiting += 1
                        metrics.QUEUE_DEPTH.labels(model).set(self.waiting)
                        self._tenant_gauges(tenant)
                    left = deadline - time.monotonic()
                    if left <= 0 and timeout_s is not None:
                        raise DeadlineExceeded("deadline passed while waiting for a worker")
                    if left <= 0:
                        raise Overloaded(f"no worker of {model!r} became free in {wait_s:.0f} s",
                                         retry_after_s=1)
                    await self._wait_for_change(min(left, 1.0))
                    if self._closed:
                        raise WorkerLost("the gateway is shutting down")
            finally:
                if not started:
                    self.queue.leave(ticket)
                    self._changed.notify_all()  # the turn may pass to another tenant
                if queued:
                    self.waiting -= 1
                    metrics.QUEUE_DEPTH.labels(model).set(self.waiting)
                self._tenant_gauges(tenant)

    async def _wait_for_change(self, timeout_s: float) -> None:
        """Until notified or timeout_s passed; the lock is held again on return, and the
        caller's cancellation is never lost (asyncio.wait_for can swallow it before 3.12,
        and a cancelled request would then take a slot for nobody)."""
        waiting = asyncio.ensure_future(self._changed.wait())
        cancelled = False
        try:
            await asyncio.wait({waiting}, timeout=timeout_s)
        except asyncio.CancelledError:
            cancelled = True
        waiting.cancel()
        # NOTE: the lock is ours again only once that wait has re-acquired it.
        while not waiting.done():
            try:
                await asyncio.wait({waiting})
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _check_room(self, ticket: Ticket) -> None:
        """A request that must wait: refused past its tenant's queue bound, then the pool's."""
        model = self.config.pool_label
        try:
            self.queue.must_wait(ticket, model)
        except TenantConcurrencyExceeded as e:
            metrics.TENANT_REFUSED.labels(model, ticket.tenant, e.reason).inc()
            raise
        if self.waiting >= self.config.max_queue:
            metrics.REJECTED.labels(model).inc()
            metrics.TENANT_REFUSED.labels(model, ticket.tenant, Overloaded.reason).inc()
            raise Overloaded(f"model {model!r} is at capacity; retry shortly", retry_after_s=1,
                             model=model)

    def _tenant_gauges(self, tenant: str) -> None:
        model = self.config.pool_label
        metrics.TENANT_INFLIGHT.labels(model, tenant).set(self.queue.inflight[tenant])
        metrics.TENANT_QUEUED.labels(model, tenant).set(self.queue.queued(tenant))

    async def release(self, worker: WorkerHandle, tenant: str = "") -> None:
        self.queue.finish(tenant)
        self._tenant_gauges(tenant)
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
        async with self._changed:
            self._changed.notify_all()

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
        return self.config.worker_threads or share_of_cores(self.config.max_workers)

    def _command(self, worker: WorkerHandle) -> list[str]:
        cmd = [sys.executable, "-m", "gateway.worker", "--socket", worker.socket_path,
               "--worker-id", worker.id, "--served-model-name", self.config.model_id,
               "--max-num-seqs", str(self.config.max_inflight),
               "--worker-threads", str(self.threads_per_worker)]
        if self._readiness is not None:
            cmd += ["--ready-socket", self._readiness.path]
        if self.config.kv_cache_bytes is not None:
            cmd += ["--kv-cache-bytes", str(self.config.kv_cache_bytes)]
        if self.config.model_path is not None:
            cmd += ["--model", self.config.model_path]
        if self.config.role != "both":
            cmd += ["--role", self.config.role]
        return cmd + list(self.config.worker_args)

    def _worker_env(self) -> dict[str, str]:
        env = {**os.environ, **thread_env(self.threads_per_worker),
               **dict(self.config.worker_env)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        return env

    async def _run(self, worker: WorkerHandle) -> None:
        """Start one worker, wait for health, then watch it until it exits."""
        start = None if self._template is None else self._template.start_worker
        assert self._readiness is not None
        ready = self._readiness.expect(worker.id)
        try:
            await worker.launch(self._command(worker), self._worker_env(),
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
        await self._notify()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        if self._readiness is not None:
            self._readiness.close()
        if self._own_run_dir and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
