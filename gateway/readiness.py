"""Readiness pushed by the worker, not polled by the gateway: each pool binds one unix datagram
socket in its run folder; a worker, spawned or forked from a template, sends one message to it
(its id and pid) the moment its gRPC server listens (`--ready-socket`, gateway/worker.py). The
waiting launch (gateway/worker_handle.py) wakes on it, and the supervisor hands the waiting
request over at once. A path, not an inherited fd: a forked worker is the template's child and
keeps none of the gateway's descriptors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass, field

_MAX_MESSAGE = 4096


@dataclass(frozen=True)
class Readiness:
    """A worker's report: its pid, its start's phases (name -> monotonic time at the end), and
    the CPU seconds it had spent by then (a forked child's since its fork; NaN: not said)."""

    pid: int
    marks: dict[str, float] = field(default_factory=dict)
    cpu_s: float = float("nan")


class ReadinessListener:
    """The gateway's end: one bound datagram socket, read on the event loop.

    `expect(worker_id)` before the worker starts gives a future that resolves to the worker's
    Readiness; a message for no expected worker, or not parseable, is dropped."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future[Readiness]] = {}
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def expect(self, worker_id: str) -> asyncio.Future[Readiness]:
        future: asyncio.Future[Readiness] = self._loop.create_future()
        self._waiting[worker_id] = future
        return future

    def forget(self, worker_id: str) -> None:
        future = self._waiting.pop(worker_id, None)
        if future is not None and not future.done():
            future.cancel()

    def _on_readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed under us
            try:
                message = json.loads(data)
                worker_id = str(message["worker"])
                report = Readiness(int(message["pid"]), {
                    str(k): float(v) for k, v in dict(message.get("marks", {})).items()},
                    float(message.get("cpu_s", "nan")))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            future = self._waiting.pop(worker_id, None)
            if future is not None and not future.done():
                future.set_result(report)

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for worker_id in list(self._waiting):
            self.forget(worker_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def notify_ready(path: str, worker_id: str, marks: dict[str, float] | None = None,
                 cpu_s: float | None = None) -> None:
    """The worker's end: tell the gateway at `path` that `worker_id` (this process) serves;
    `marks`: its start's phases, name -> time.monotonic() at the phase's end (one clock for
    every process of the host); `cpu_s`: the CPU seconds its start took. Raises OSError when
    nobody listens there (the gateway is gone)."""
    body: dict[str, object] = {"worker": worker_id, "pid": os.getpid(), "marks": marks or {}}
    if cpu_s is not None:
        body["cpu_s"] = round(cpu_s, 4)
    message = json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message, path)


def start_phases(started_at: float, process_at: float, marks: dict[str, float],
                 ready_at: float) -> dict[str, float]:
    """Seconds per phase of a worker's start, in order: `process` (the gateway's fork request to
    the template, or the spawn), then each of the worker's marks (a forked child's `forked` and
    `setup`, then `main` (a spawned one's interpreter and imports), `engine` (weights and KV
    pool), `warm_up`, `serve` (its gRPC server)), then `ready` (the push to the first Status
    answered). All times are time.monotonic()."""
    phases = {"process": process_at - started_at}
    last = process_at
    for name, at in sorted(marks.items(), key=lambda kv: kv[1]):
        phases[name] = max(at - last, 0.0)
        last = max(at, last)
    phases["ready"] = ready_at - last
    return {k: round(v, 4) for k, v in phases.items()}
