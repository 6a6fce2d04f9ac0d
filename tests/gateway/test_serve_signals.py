"""`tessera serve` as a user runs it, stopped the ways a user or an orchestrator stops it.

SIGTERM under load drains: new requests get a typed UNAVAILABLE, in-flight ones have the grace
period, and what is left ends with a typed error in its protocol's own shape (gRPC status,
JSON error body, SSE error event). SIGKILL, or Ctrl-C before the workers are ready, leaves no
worker process and no socket folder behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.client import NO_RETRY, Client, TesseraError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KEY = "key-signals"
KEY_HINT = "YOUR_KEY"  # what serve prints in its hints when keys come from --api-keys
# Outlasts every grace period here: 600 tokens ended inside an 8 s grace once decode passed
# ~50 tok/s (the fused decode step); 1500 take over 20 s at any speed this box reaches.
LONG = {"max_tokens": 1500, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked_processes(mark: str) -> list[int]:
    """PIDs whose environment carries this test's mark: the gateway and its workers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"TESSERA_TEST_MARK={mark}".encode() in env.split(b"\0"):
            found.append(int(pid))
    return found


class Served:
    def __init__(self, tmp: Path, grace_s: float, terminal_group: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        self.mark = uuid.uuid4().hex
        self.tmp = tmp
        self.grpc_port, self.http_port = _free_port(), _free_port()
        keys = tmp / "keys"
        keys.write_text(f"{KEY}=tenant\n")
        env = {**os.environ, "TMPDIR": str(tmp), "TESSERA_TEST_MARK": self.mark}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(self.grpc_port),
             "--http-port", str(self.http_port), "--api-keys", str(keys),
             "--kv-cache-bytes", str(256 << 20), "--shutdown-grace-s", str(grace_s), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=terminal_group)  # its own group, as a shell's foreground job
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for_line(self, text: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, f"tessera serve exited: {self.lines}"
            assert time.monotonic() < deadline, f"no {text!r} in {self.lines}"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def leftovers(self) -> tuple[list[int], list[Path]]:
        return _marked_processes(self.mark), list(self.tmp.glob("tessera-*"))

    def assert_left_clean(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.leftovers() == ([], []), "a worker or a socket folder was left behind"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    started: list[Served] = []

    def start(grace_s: float = 2.0, terminal_group: bool = False,
              extra: tuple[str, ...] = ()) -> Served:
        started.append(Served(tmp_path, grace_s, terminal_group, extra))
        return started[-1]

    yield start  # type: ignore[misc]
    for s in started:
        for pid in s.leftovers()[0]:
            os.kill(pid, signal.SIGKILL)


def test_sigterm_under_load_ends_every_protocol_typed(served) -> None:
    s = served(grace_s=2.0)
    s.wait_for_line("call it:")
    results: dict[str, object] = {}
    auth = {"authorization": f"Bearer {KEY}"}

    def grpc_stream() -> None:
        with Client(f"127.0.0.1:{s.grpc_port}", api_key=KEY, retry=NO_RETRY) as c:
            try:
                list(c.generate("Count to a thousand:", **LONG))
                results["grpc"] = "completed"
            except TesseraError as e:
                results["grpc"] = e.reason

    def rest_unary() -> None:
        r = httpx.post(f"{s.url}/v1/completions", headers=auth, timeout=60,
                       json={"prompt": "Count to a thousand:", **LONG})
        results["rest"] = (r.status_code, r.headers.get("content-type"), r.json())

    def rest_sse() -> None:
        events = []
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", headers=auth, timeout=60,
                          json={"messages": [{"role": "user", "content": "Count:"}],
                                "stream": True, **LONG}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        results["sse"] = events

    threads = [threading.Thread(target=f) for f in (grpc_stream, rest_unary, rest_sse)]
    for t in threads:
        t.start()
    time.sleep(3)  # all three are decoding
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with Client(f"127.0.0.1:{s.grpc_port}", api_key=KEY, retry=NO_RETRY) as c:
        with pytest.raises(TesseraError) as refused:
            list(c.generate("Hi", max_tokens=2))
    late = httpx.post(f"{s.url}/v1/completions", headers=auth, timeout=30,
                      json={"prompt": "Hi", "max_tokens": 2})
    for t in threads:
        t.join(60)
    assert s.proc.wait(60) == 0

    assert refused.value.reason == "UNAVAILABLE" and refused.value.retryable
    assert late.status_code == 503 and late.json()["error"]["reason"] == "UNAVAILABLE"
    assert results["grpc"] == "UNAVAILABLE"
    status, content_type, body = results["rest"]  # type: ignore[misc]
    assert status == 503 and "application/json" in content_type
    assert body["error"]["reason"] == "UNAVAILABLE"
    events = results["sse"]
    assert events and json.loads(events[-1])["error"]["reason"] == "UNAVAILABLE"
    s.assert_left_clean()


def test_sigkill_leaves_no_worker_and_no_socket_folder(served) -> None:
    s = served()
    s.wait_for_line("call it:")
    assert len(s.leftovers()[0]) >= 2 and s.leftovers()[1]
    s.proc.kill()
    s.proc.wait(10)
    s.assert_left_clean()


def test_the_printed_curl_line_is_answered(served) -> None:
    s = served()
    s.wait_for_line("call it:")
    s.wait_for_line("curl -s ")
    (line,) = [ln for ln in s.lines if ln.strip().startswith("curl -s ")]
    done = subprocess.run(["bash", "-c", line.strip().replace(KEY_HINT, KEY)],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["choices"][0]["message"]["content"], done.stdout


def test_sigkill_of_a_tensor_parallel_gateway_leaves_no_rank_and_no_rendezvous(served) -> None:
    # the group's rendezvous folder used to be a tessera-tp-* folder in $TMPDIR, left behind
    s = served(extra=("--tp", "2"))
    s.wait_for_line("call it:")
    s.proc.kill()
    s.proc.wait(10)
    s.assert_left_clean()


def test_ctrl_c_before_the_workers_are_ready_leaves_nothing_behind(served) -> None:
    s = served()
    s.wait_for_line("starting workers", timeout_s=60)
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(60) == 0
    s.assert_left_clean()


def test_ctrl_c_at_a_terminal_drains_like_sigterm(served) -> None:
    # A terminal's Ctrl-C signals the whole foreground process group, workers included: they
    # must leave stopping to the gateway, which drains, instead of dying under their requests.
    s = served(grace_s=8.0, terminal_group=True)  # longer than a worker's own 5 s stop grace
    s.wait_for_line("call it:")
    result: dict[str, str] = {}

    def grpc_stream() -> None:
        with Client(f"127.0.0.1:{s.grpc_port}", api_key=KEY, retry=NO_RETRY) as c:
            try:
                list(c.generate("Count to a thousand:", **LONG))
                result["grpc"] = "completed"
            except TesseraError as e:
                result["grpc"] = e.reason

    t = threading.Thread(target=grpc_stream)
    t.start()
    time.sleep(3)  # decoding
    os.killpg(s.proc.pid, signal.SIGINT)
    t.join(60)
    assert s.proc.wait(60) == 0
    assert result["grpc"] == "UNAVAILABLE"  # the grace period ran out; the worker did not die
    s.assert_left_clean()
