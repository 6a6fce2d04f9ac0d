"""`tessera serve`'s start with a worker template (gateway/serve.py, gateway/template_launch.py):
the template is started before the gateway's own modules load, its first fork serves the
first request, a template that fails at import leaves the workers spawned (with a warning), and
a stop before the template has loaded leaves no process behind."""

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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.client import Client

KEY = "key-template-start"
ROOT = Path(__file__).resolve().parents[2]
# What serve runs before it starts its templates: none of the gateway's servers or logging.
_BEFORE_LAUNCH = """
import sys
from ops.cli import build_parser
from gateway.serve import pool_config, pool_configs
from gateway.template_launch import launch_pool_template
args = build_parser().parse_args(["serve", "--max-workers", "2"])
pool_configs(pool_config(args), args)
print(json.dumps(sorted(m for m in ("grpc", "asyncio", "structlog", "torch", "fastapi",
                                     "prometheus_client", "gateway.runner")
                        if m in sys.modules)))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _marked(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"TESSERA_TEST_MARK={mark}".encode() in env.split(b"\0"):
            found.append(int(pid))
    return found


class Serve:
    """`tessera serve --min-workers 1 --max-workers 2` (a pool that can grow: a template),
    its output (stdout and the JSON log) collected line by line."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.port = _free_port()
        keys = tmp / "keys"
        keys.write_text(f"{KEY}=tenant\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(self.port),
             "--http-port", str(_free_port()), "--api-keys", str(keys), "--min-workers", "1",
             "--max-workers", "2", "--worker-threads", "1", "--kv-cache-bytes", str(32 << 20)],
            env={**os.environ, "TMPDIR": str(tmp), "TESSERA_TEST_MARK": self.mark,
                 **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def events(self, name: str) -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("{"):
                message = json.loads(line)
                if message.get("event") == name:
                    out.append(message)
        return out

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"tessera serve exited: {self.lines}"
            assert time.monotonic() < deadline, f"no {what} in {self.lines}"
            time.sleep(0.05)

    def first_tokens(self) -> list[int]:
        """The first request's tokens, sent as soon as the gRPC port takes it (the worker is
        still starting then: the request waits for it)."""
        self.wait_for("gateway line", lambda: any("tessera gateway on" in ln
                                                  for ln in self.lines))
        with Client(f"127.0.0.1:{self.port}", api_key=KEY) as client:
            stream = client.generate("The capital of France is", max_tokens=4,
                                     temperature=0.0, ignore_eos=True)
            return [t for chunk in stream for t in chunk.token_ids]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        deadline = time.monotonic() + 20
        while _marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _marked(self.mark) == [], "a template or worker was left behind"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    started: list[Serve] = []

    def start(env: dict[str, str] | None = None) -> Serve:
        started.append(Serve(tmp_path, env))
        return started[-1]

    yield start
    for s in started:
        for pid in _marked(s.mark):
            os.kill(pid, signal.SIGKILL)


def test_serve_starts_its_template_before_loading_the_gateways_modules() -> None:
    # the template's import of torch overlaps the gateway's start only if nothing heavy is
    # imported before it is launched
    done = subprocess.run([sys.executable, "-c", "import json\n" + _BEFORE_LAUNCH],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serves_first_request_from_the_templates_first_fork(serve) -> None:
    s = serve()
    tokens = s.first_tokens()
    assert len(tokens) == 4
    (ready,) = s.events("worker template ready")
    (worker,) = s.events("worker ready")
    assert _parent(worker["pid"]) == ready["pid"] != s.proc.pid  # forked by the template
    assert _parent(ready["pid"]) == s.proc.pid
    assert not s.events("worker template unavailable: workers are spawned")
    s.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_template_that_fails_at_import_leaves_workers_spawned(serve, tmp_path: Path) -> None:
    # a sitecustomize that makes torch unimportable in the template process only
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    if b'gateway.template_process' in f.read():\n"
        "        sys.modules['torch'] = None\n")
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    s = serve({"PYTHONPATH": path})
    tokens = s.first_tokens()
    assert len(tokens) == 4
    (warning,) = s.events("worker template unavailable: workers are spawned")
    assert "torch" in warning["error"]
    (worker,) = s.events("worker ready")
    assert _parent(worker["pid"]) == s.proc.pid  # spawned by the gateway
    s.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_while_the_template_loads_leaves_nothing_behind(serve) -> None:
    s = serve()
    s.wait_for("gateway line", lambda: any("tessera gateway on" in ln for ln in s.lines))
    s.proc.send_signal(signal.SIGINT)  # the template is loading still (~1.5 s of CPU left)
    assert s.proc.wait(60) == 0
    s.stop()
