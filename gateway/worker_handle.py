"""The gateway's handle on one worker process: its process, unix-socket channel and load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.errors import WorkerLost
from gateway.readiness import Readiness, start_phases
from gateway.start_failures import StderrTail
from gateway.wire import ServedInfo

# (command, env) -> a started process: asyncio's, or gateway.template.ForkedProcess
StartProcess = Callable[[list[str], dict[str, str]], Awaitable[Any]]


async def _spawn(command: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *command, env=env, stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)


class WorkerHandle:
    def __init__(self, worker_id: str, socket_path: str, max_inflight: int) -> None:
        self.id = worker_id
        self.socket_path = socket_path
        self.max_inflight = max_inflight
        # starting -> ready -> draining -> stopped; "lost" when calls to it fail (then it exits)
        self.state = "starting"
        self.inflight = 0
        self.requests_served = 0
        self.started_at = time.monotonic()
        self.ready_at = 0.0
        self.last_used = self.started_at
        self.process: Any = None  # asyncio.subprocess.Process or a ForkedProcess
        self.channel: grpc.aio.Channel | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None
        self.status: wpb.StatusResponse | None = None
        self.missed_health = 0
        # phase -> seconds of its start (start_phases), once ready
        self.start_phases: dict[str, float] = {}
        self.start_cpu_s = float("nan")  # CPU seconds of its start, as it reported them
        self.stderr = StderrTail()  # relayed to the gateway's stderr; its last error line kept

    @property
    def available(self) -> bool:
        return self.state == "ready" and self.inflight < self.max_inflight

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def cold_start_s(self) -> float:
        return self.ready_at - self.started_at

    @property
    def served(self) -> ServedInfo | None:
        if self.status is None:
            return None
        return ServedInfo.from_proto(self.status.served)

    async def launch(self, command: list[str], env: dict[str, str], timeout_s: float,
                     ready: asyncio.Future[Readiness], start: StartProcess | None = None) -> None:
        """Start the process (with `start`, e.g. a fork from the pool's template, else a
        spawn) and return once it has pushed its readiness (`ready`, from the pool's
        gateway.readiness.ReadinessListener) and answered
        one Status call. Raises WorkerLost when it exits first, reports another pid, or has not
        reported within `timeout_s` of its start (then it is killed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        # NOTE: a session of its own, so a terminal's Ctrl-C (sent to the whole foreground
        # group) reaches only the gateway, which drains and then stops its workers; the worker
        # still exits with its parent (gateway/worker.py: _exit_with_parent).
        self.process = await (start or _spawn)(command, env)
        process_at = time.monotonic()
        if getattr(self.process, "stderr", None) is not None:
            self.stderr.follow(self.process.stderr)
        self.channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        exited = asyncio.ensure_future(self.process.wait())
        left = self.started_at + timeout_s - time.monotonic()
        try:
            await asyncio.wait({ready, exited}, timeout=max(left, 0.0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if self.process.returncode is not None or self.state == "stopped":
            raise WorkerLost(f"worker {self.id} exited during start",
                             exit_code=self.process.returncode)
        if not ready.done() or ready.cancelled():
            self.kill()
            raise WorkerLost(f"worker {self.id} did not report ready in {timeout_s:.0f} s")
        report = ready.result()
        if report.pid != self.process.pid:  # NOTE: fail closed on whose socket it is
            self.kill()
            raise WorkerLost(f"worker {self.id} readiness came from pid {report.pid}, "
                             f"not {self.process.pid}")
        try:
            self.status = await self.stub.Status(wpb.StatusRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            self.kill()
            raise WorkerLost(f"worker {self.id} reported ready but does not answer: "
                             f"{e.code().name}") from e
        if self.state == "starting":
            self.ready_at = time.monotonic()
            self.state = "ready"
            self.start_phases = start_phases(self.started_at, process_at, report.marks,
                                             self.ready_at)
            self.start_cpu_s = report.cpu_s

    async def read_status(self, timeout_s: float = 2.0) -> wpb.StatusResponse | None:
        try:
            self.status = await self.stub.Status(wpb.StatusRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, AttributeError):
            return None
        return self.status

    async def probe_health(self, timeout_s: float = 1.0) -> wpb.HealthResponse | None:
        """The worker's Health (its engine loop's pulse), or None when it does not answer."""
        try:
            return await self.stub.Health(wpb.HealthRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, AttributeError):
            return None

    async def answers_health(self, timeout_s: float = 1.0) -> bool:
        try:
            return (await self.stub.Health(wpb.HealthRequest(), timeout=timeout_s)).serving
        except (grpc.aio.AioRpcError, AttributeError):
            return False

    async def wait_exit(self) -> int | None:
        if self.process is None:
            return None
        code = await self.process.wait()
        # NOTE: the channel stays open: closing it would turn the in-flight calls' UNAVAILABLE
        # (-> WORKER_LOST) into local cancellations. close_channel() runs once they are done.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        return code

    async def close_channel(self) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            await channel.close()

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the worker drains its server), SIGKILL past the grace period."""
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            self.kill()
            await proc.wait()
