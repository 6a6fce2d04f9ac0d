"""Readiness pushed by the worker (gateway/readiness.py): the gateway waits on the worker's own
message, on a real unix datagram socket, from a real process; it fails closed on a message
from another pid and on a process that exits before it reports."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.errors import WorkerLost
from gateway.readiness import Readiness, ReadinessListener, start_phases
from gateway.worker_handle import WorkerHandle


def _notify_from_a_process(path: str, worker_id: str) -> None:
    code = f"from gateway.readiness import notify_ready; notify_ready({path!r}, {worker_id!r})"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_expected_worker_s_message_resolves_to_its_pid(tmp_path: Path) -> None:
    async def run() -> tuple[int, int]:
        listener = ReadinessListener(str(tmp_path / "ready.sock"))
        try:
            ready = listener.expect("w-1")
            code = ("import os; from gateway.readiness import notify_ready; "
                    f"notify_ready({listener.path!r}, 'w-1'); print(os.getpid())")
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                        stdout=subprocess.PIPE)
            out, _ = await proc.communicate()
            return (await asyncio.wait_for(ready, 10)).pid, int(out)
        finally:
            listener.close()

    reported, pid = asyncio.run(run())
    assert reported == pid


def test_the_cpu_seconds_a_worker_reports_reach_the_gateway(tmp_path: Path) -> None:
    async def run() -> tuple[float, float]:
        listener = ReadinessListener(str(tmp_path / "ready.sock"))
        try:
            said, unsaid = listener.expect("w-1"), listener.expect("w-2")
            code = ("from gateway.readiness import notify_ready; "
                    f"notify_ready({listener.path!r}, 'w-1', cpu_s=0.25); "
                    f"notify_ready({listener.path!r}, 'w-2')")
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
            await proc.wait()
            return ((await asyncio.wait_for(said, 10)).cpu_s,
                    (await asyncio.wait_for(unsaid, 10)).cpu_s)
        finally:
            listener.close()

    said, unsaid = asyncio.run(run())
    assert said == 0.25 and math.isnan(unsaid)


def test_messages_for_no_expected_worker_or_garbled_are_dropped(tmp_path: Path) -> None:
    async def run() -> bool:
        listener = ReadinessListener(str(tmp_path / "ready.sock"))
        try:
            ready = listener.expect("w-2")
            await asyncio.to_thread(_notify_from_a_process, listener.path, "w-other")
            import socket

            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"not json", listener.path)
            await asyncio.sleep(0.2)
            return ready.done()
        finally:
            listener.close()

    assert asyncio.run(run()) is False


def _launch(tmp_path: Path, code: str, reported_pid: int | None,
            timeout_s: float = 30) -> WorkerHandle:
    handle = WorkerHandle("w-3", str(tmp_path / "w.sock"), 1)

    async def start(command: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(sys.executable, "-c", code)

    async def run() -> None:
        ready: asyncio.Future[Readiness] = asyncio.get_running_loop().create_future()
        if reported_pid is not None:
            ready.set_result(Readiness(reported_pid))
        try:
            await handle.launch([], {}, timeout_s, ready, start)
        finally:
            if handle.process is not None and handle.process.returncode is None:
                await handle.process.wait()

    asyncio.run(run())
    return handle


def test_readiness_from_another_pid_kills_the_worker(tmp_path: Path) -> None:
    with pytest.raises(WorkerLost, match="pid 1,"):
        _launch(tmp_path, "import time; time.sleep(60)", reported_pid=1)


def test_a_worker_that_exits_before_reporting_fails_its_start(tmp_path: Path) -> None:
    with pytest.raises(WorkerLost, match="exited during start"):
        _launch(tmp_path, "raise SystemExit(3)", reported_pid=None)


def test_a_worker_that_never_reports_is_killed_at_its_start_timeout(tmp_path: Path) -> None:
    with pytest.raises(WorkerLost, match="did not report ready"):
        _launch(tmp_path, "import time; time.sleep(60)", reported_pid=None, timeout_s=0.5)


def test_start_phases_are_the_gaps_between_the_marks_in_order() -> None:
    marks = {"warm_up": 10.5, "main": 10.1, "engine": 10.3, "serve": 10.6}
    phases = start_phases(10.0, 10.05, marks, 10.65)
    assert list(phases) == ["process", "main", "engine", "warm_up", "serve", "ready"]
    assert phases == pytest.approx({"process": 0.05, "main": 0.05, "engine": 0.2,
                                    "warm_up": 0.2, "serve": 0.1, "ready": 0.05})
    assert sum(phases.values()) == pytest.approx(0.65)
