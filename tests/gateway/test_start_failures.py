"""A worker that cannot start fails loudly: after --worker-start-failures failed starts in a row
the model's requests get WORKER_START_FAILED at once (gRPC UNAVAILABLE, REST 503) with the
worker's last error line, /v1/models says so, `tessera serve` never prints "workers ready" and
exits non-zero once its start timeout passes; and a pool whose cause goes away serves again by
itself (gateway/start_failures.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import NO_RETRY, Client, TesseraError, WorkerStartFailed
from gateway.start_failures import StderrTail, error_line
from runtime.loader import default_model_path

KEY = "key-start"


def test_the_cause_is_a_tracebacks_last_line():
    lines = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "    import msgpack", "ModuleNotFoundError: No module named 'msgpack'", ""]
    assert error_line(lines) == "ModuleNotFoundError: No module named 'msgpack'"


def test_the_cause_is_an_error_log_records_reason_and_error():
    lines = ['{"event": "loading", "level": "info"}',
             '{"reason": "MODEL_NOT_FOUND", "error": "model path \'/m\' does not exist", '
             '"event": "worker failed to start", "level": "error"}']
    assert error_line(lines) == "MODEL_NOT_FOUND: model path '/m' does not exist"
    assert error_line(['{"event": "ok", "level": "info"}', "plain words"]) is None


def test_a_workers_stderr_is_drained_to_the_end_even_past_a_huge_line(capfd):
    async def relay() -> str | None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; sys.stderr.write('x' * 300_000 + '\\n' + "
            "'big\\n' * 20_000 + 'ValueError: bad flag\\n')", stderr=asyncio.subprocess.PIPE)
        tail = StderrTail()
        tail.follow(proc.stderr)
        await asyncio.wait_for(proc.wait(), 60)  # would block on a full pipe
        return await tail.error_line()

    assert asyncio.run(relay()) == "ValueError: bad flag"
    assert "big\n" in capfd.readouterr().err  # relayed to the gateway's stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """`tessera serve` as a user runs it, with a model path that does not exist (yet)."""

    def __init__(self, tmp: Path, model: Path, start_timeout_s: float,
                 dev_key: bool = False) -> None:
        self.grpc_port, self.http_port = _free_port(), _free_port()
        keys = tmp / "keys"
        keys.write_text(f"{KEY}=tenant\n")
        env = {k: v for k, v in os.environ.items() if k != "TESSERA_API_KEYS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(self.grpc_port),
             "--http-port", str(self.http_port), *([] if dev_key else ["--api-keys", str(keys)]),
             "--model", str(model),
             "--kv-cache-bytes", str(256 << 20), "--worker-start-failures", "1",
             "--max-restart-backoff-s", "2", "--worker-start-timeout-s", str(start_timeout_s)],
            env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(s), daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None, f"tessera serve exited: {self.out} {self.err}"
            assert time.monotonic() < deadline, f"no {text!r} in {self.out}"
            time.sleep(0.1)

    def generate(self) -> str:
        with Client(f"127.0.0.1:{self.grpc_port}", api_key=KEY, retry=NO_RETRY,
                    timeout_s=120) as c:
            return "".join(ch.text for ch in c.generate("Hello", max_tokens=4))

    def rest(self, path: str, body: dict | None = None) -> httpx.Response:
        auth = {"authorization": f"Bearer {KEY}"}
        url = f"http://127.0.0.1:{self.http_port}{path}"
        if body is None:
            return httpx.get(url, headers=auth, timeout=60)
        return httpx.post(url, headers=auth, json=body, timeout=60)


@pytest.fixture
def served(tmp_path):
    started: list[Served] = []

    def start(model: Path, start_timeout_s: float, dev_key: bool = False) -> Served:
        started.append(Served(tmp_path, model, start_timeout_s, dev_key))
        return started[-1]

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_cannot_start_gives_a_typed_error_and_serve_exits_non_zero(
        served, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    s = served(missing, start_timeout_s=25)
    s.wait_for("REST shim on")
    with pytest.raises(WorkerStartFailed) as failed:  # waits for the one start, then at once
        s.generate()
    assert failed.value.reason == "WORKER_START_FAILED"
    assert "MODEL_NOT_FOUND" in failed.value.message and str(missing) in failed.value.message
    start = time.monotonic()
    with pytest.raises(TesseraError) as again:
        s.generate()
    assert again.value.reason == "WORKER_START_FAILED" and time.monotonic() - start < 5
    r = s.rest("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_start_failed"
    assert str(missing) in r.json()["error"]["message"]
    model = s.rest("/v1/models").json()["data"][0]
    assert model["state"] == "failed" and str(missing) in model["start_error"]
    with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert s.proc.wait(timeout=120) != 0
    assert not any("workers ready" in line for line in s.out)
    assert any("became ready" in line and str(missing) in line for line in s.err), s.err[-5:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pool_whose_cause_goes_away_serves_again_by_itself(served, tmp_path):
    path = tmp_path / "model.gguf"
    s = served(path, start_timeout_s=300)
    s.wait_for("REST shim on")
    with pytest.raises(TesseraError) as failed:
        s.generate()
    assert failed.value.reason == "WORKER_START_FAILED"
    path.symlink_to(default_model_path())  # the model arrives where the flag said
    s.wait_for("workers ready", timeout_s=400)  # a cold start on a loaded 2-core box
    assert s.generate()
    assert s.rest("/v1/models").json()["data"][0]["state"] == "ready"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dev_key_is_printed_before_the_workers_so_a_client_can_hear_why_none_starts(
        served, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    s = served(missing, start_timeout_s=60, dev_key=True)
    s.wait_for("REST shim on")
    s.wait_for("dev API key")
    key = next(line for line in s.out if "dev API key" in line).split()[-1]
    r = httpx.post(f"http://127.0.0.1:{s.http_port}/v1/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {key}"},
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_start_failed", r.text
    assert not any("workers ready" in line for line in s.out)
