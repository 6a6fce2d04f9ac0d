"""Ports that are taken say so: every listening socket is bound exclusively, `tessera serve`
checks its ports before it starts a worker and refuses a taken one with one line and a non-zero
exit, leaving the server that holds it untouched; a second Ctrl-C ends a drain at once."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.auth import ApiKeys
from gateway.client import NO_RETRY, Client, TesseraError
from gateway.grpc_server import Gateway, build_server
from gateway.ports import PortInUse, check_free
from gateway.supervisor import PoolConfig, WorkerPool

KEY = "key-ports"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_with_a_listener_is_refused_in_one_line_and_a_free_one_passes():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUse) as taken:
            check_free("127.0.0.1", {"--http-port": _free_port(), "--grpc-port": port})
        assert str(taken.value).startswith(f"port {port} is in use (--grpc-port)")
        assert "\n" not in str(taken.value)
    check_free("127.0.0.1", {"--grpc-port": port, "--metrics-port": None})


def test_a_second_grpc_server_cannot_share_a_bound_port():
    async def bind_twice() -> None:
        gateway = Gateway({"m": WorkerPool(PoolConfig("m", min_workers=0))}, ApiKeys({}))
        first, port = await build_server(gateway, "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(PortInUse, match=f"port {port} is in use"):
                await build_server(gateway, "127.0.0.1", port)
        finally:
            await first.stop(None)

    asyncio.run(bind_twice())


class Served:
    def __init__(self, tmp: Path, grpc_port: int, http_port: int) -> None:
        keys = tmp / "keys"
        keys.write_text(f"{KEY}=tenant\n")
        self.grpc_port = grpc_port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(grpc_port),
             "--http-port", str(http_port), "--api-keys", str(keys),
             "--kv-cache-bytes", str(256 << 20), "--shutdown-grace-s", "60"],
            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(s), daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None, f"tessera serve exited: {self.out} {self.err}"
            assert time.monotonic() < deadline, f"no {text!r} in {self.out}"
            time.sleep(0.1)

    def client(self) -> Client:
        return Client(f"127.0.0.1:{self.grpc_port}", api_key=KEY, retry=NO_RETRY, timeout_s=120)


@pytest.fixture
def first(tmp_path):
    s = Served(tmp_path, _free_port(), _free_port())
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_serve_on_a_taken_port_exits_in_one_line_and_the_first_serves_on(
        first, tmp_path):
    first.wait_for("call it:")
    http_port = int(next(ln for ln in first.out if "REST shim on" in ln)
                    .split("127.0.0.1:")[1].split()[0])
    for grpc_port, http, flag, port in ((first.grpc_port, _free_port(), "--grpc-port",
                                         first.grpc_port),
                                        (_free_port(), http_port, "--http-port", http_port)):
        start = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(grpc_port),
             "--http-port", str(http)], capture_output=True, text=True, timeout=120,
            env={**os.environ, "TMPDIR": str(tmp_path)})
        assert second.returncode != 0
        assert second.stderr.strip().splitlines() == [
            f"tessera serve: port {port} is in use ({flag}): stop what holds it or pick "
            "another port"]
        assert "starting workers" not in second.stdout  # refused before any worker
        assert time.monotonic() - start < 60
    with first.client() as c:
        assert "".join(ch.text for ch in c.generate("Hello", max_tokens=4))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_ctrl_c_ends_the_drain_at_once(first):
    first.wait_for("call it:")
    outcome: dict[str, str] = {}

    def long_request() -> None:
        with first.client() as c:
            try:
                list(c.generate("Count to a thousand:", max_tokens=4000, ignore_eos=True))
                outcome["grpc"] = "completed"
            except TesseraError as e:
                outcome["grpc"] = e.reason

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(3)  # the request is running
    first.proc.send_signal(signal.SIGINT)
    first.wait_for("draining", timeout_s=30)
    time.sleep(1)
    start = time.monotonic()
    first.proc.send_signal(signal.SIGINT)
    code = first.proc.wait(timeout=40)
    assert time.monotonic() - start < 30  # not the 60 s grace
    assert code == 130 and any("stopping now" in ln for ln in first.out)
    thread.join(30)
    assert outcome["grpc"] in ("UNAVAILABLE", "WORKER_LOST")
