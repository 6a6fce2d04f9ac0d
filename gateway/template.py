"""The gateway's side of a model's worker template (gateway/template_process.py): start it,
ask it to fork a worker, and watch that worker as if it were our own child. When the template
is not alive, died, or cannot fork, a worker is spawned as before, with a warning."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Any

from gateway.logs import get_logger
from gateway.template_launch import (  # noqa: F401  (uses_template: re-exported)
    LaunchedTemplate,
    launch_template,
    template_argv,
    uses_template,
)

log = get_logger("tessera.template")


class TemplateUnavailable(Exception):
    """The template is not running or refused to fork."""


class ForkedProcess:
    """A worker forked by the template, watched through a pidfd (it is the template's child,
    not ours): the part of `asyncio.subprocess.Process` the supervisor uses."""

    def __init__(self, pid: int, template: WorkerTemplate) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._template = template
        self._pidfd = os.pidfd_open(pid)
        self._exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        # the exit code comes from the template, which reaps; -1 when it cannot tell (gone)
        self.returncode = await self._template.exit_code(self.pid, timeout_s=1.0)
        os.close(self._pidfd)
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self._exited.is_set():
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WorkerTemplate:
    """One template process for one pool's workers (same model, flags and environment)."""

    def __init__(self, worker_command: list[str], env: dict[str, str],
                 launched: LaunchedTemplate | None = None) -> None:
        self._command = worker_command
        self._env = env
        self._launched = launched  # started before the event loop (tessera serve), or None
        self._process: subprocess.Popen | None = None
        self._commands_fd: int | None = None  # its stdin, non-blocking
        self._replies: asyncio.StreamReader | None = None
        self._reader: asyncio.Task | None = None
        self._pending: asyncio.Future | None = None
        self._fork_lock = asyncio.Lock()
        self._exit_codes: dict[int, int] = {}
        self._exit_changed = asyncio.Event()
        self.ready = asyncio.Event()  # set once the template has loaded, or failed to
        self.phases: dict[str, float] = {}  # its load's, wall seconds (CPU: cpu_phases)
        self.cpu_phases: dict[str, float] = {}
        self.failed: str | None = None
        self._closing = False

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.poll() is None
                and self.ready.is_set() and self.failed is None)

    async def start(self, timeout_s: float) -> None:
        """Adopt the template launched for this pool (or start it now) and wait until it has
        loaded (or `timeout_s` passed); on any failure it is marked failed and workers are
        spawned."""
        if self._closing:
            return
        launched = self._launched
        if launched is None or launched.command != self._command or launched.adopted:
            if launched is not None:
                launched.close()  # NOTE: started for other flags: not this pool's template
            try:
                launched = launch_template(self._command, self._env)
            except OSError as e:
                self._fail(f"cannot start: {e}")
                return
        launched.adopted = True
        self._process = launched.process
        assert self._process.stdin is not None
        self._commands_fd = self._process.stdin.fileno()
        os.set_blocking(self._commands_fd, False)
        loop = asyncio.get_running_loop()
        self._replies = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self._replies),
                                     os.fdopen(launched.replies_fd, "rb", buffering=0))
        self._reader = asyncio.create_task(self._read_replies())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        if not self.ready.is_set():
            self._fail(f"not loaded after {timeout_s:.0f} s")

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            if not self._closing:  # NOTE: its exit after close() is no fallback to warn of
                log.warning("worker template unavailable: workers are spawned", error=why)
        self.ready.set()
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(TemplateUnavailable(why))

    async def _read_replies(self) -> None:
        assert self._replies is not None
        while True:
            line = await self._replies.readline()
            if not line:
                self._fail("the template exited")
                self._exit_changed.set()
                return
            message: dict[str, Any] = json.loads(line)
            op = message.get("op")
            if op == "ready":
                self.phases = message.get("phases", {})
                self.cpu_phases = message.get("cpu_phases", {})
                log.info("worker template ready", pid=message.get("pid"), phases=self.phases)
                self.ready.set()
            elif op == "phases":  # the load's part done after "ready" (finish_load)
                self.phases.update(message.get("phases", {}))
                self.cpu_phases.update(message.get("cpu_phases", {}))
            elif op == "exited":
                self._exit_codes[int(message["pid"])] = int(message["code"])
                self._exit_changed.set()
                self._exit_changed = asyncio.Event()
            elif self._pending is not None and not self._pending.done():
                self._pending.set_result(message)
            elif op == "error":  # a load failure, before any fork was asked for
                self._fail(str(message.get("error")))

    async def exit_code(self, pid: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while pid not in self._exit_codes:
            left = deadline - time.monotonic()
            if left <= 0 or self._reader is None or self._reader.done():
                return -1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_changed.wait(), left)
        return self._exit_codes.pop(pid)

    async def fork(self, worker_command: list[str], timeout_s: float = 30.0) -> ForkedProcess:
        """A worker forked from the template for `worker_command` (gateway.worker's command
        line; its environment is the template's). Raises TemplateUnavailable."""
        if not self.alive or self._commands_fd is None:
            raise TemplateUnavailable(self.failed or "the template is not running")
        async with self._fork_lock:
            self._pending = asyncio.get_running_loop().create_future()
            line = (json.dumps({"op": "fork", "argv": template_argv(worker_command)})
                    + "\n").encode()
            try:
                # NOTE: one short line to a template that reads its commands while idle; a pipe
                # it left full (BlockingIOError) is one that does not answer
                if os.write(self._commands_fd, line) != len(line):
                    raise OSError("the fork command was cut short")
                reply = await asyncio.wait_for(self._pending, timeout_s)
            except (OSError, TimeoutError) as e:
                self._fail(f"no answer to a fork: {e!r}")
                raise TemplateUnavailable(str(e)) from e
            finally:
                self._pending = None
        if reply.get("op") != "forked":
            raise TemplateUnavailable(str(reply.get("error")))
        return ForkedProcess(int(reply["pid"]), self)

    async def start_worker(self, command: list[str], env: dict[str, str]) -> Any:
        """Fork a worker from the template, or spawn it (with a warning) when that fails."""
        if not self.ready.is_set():
            await self.ready.wait()
        try:
            return await self.fork(command)
        except TemplateUnavailable as e:
            log.warning("worker spawned: the template cannot fork", error=str(e))
        return await asyncio.create_subprocess_exec(
            *command, env=env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def close(self) -> None:
        self._closing = True
        if self._launched is not None and not self._launched.adopted:
            self._launched.close()  # NOTE: never adopted (the pool closed before it started)
        proc = self._process
        if proc is None or proc.poll() is not None:
            return
        if proc.stdin is not None:
            proc.stdin.close()  # the template exits on EOF; its workers stay with the gateway
        self._commands_fd = None
        if not self.ready.is_set():
            proc.terminate()  # NOTE: still loading, it reads no command; it has no worker yet
        if not await _exited(proc, 5.0):
            proc.kill()
            await _exited(proc, 5.0)
        if self._reader is not None:
            self._reader.cancel()


async def _exited(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `proc` exited (and was reaped) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
