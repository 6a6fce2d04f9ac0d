"""The start-up measures ops/bench/bench_scale_from_zero.py reports beside its cold penalty:
`tessera serve` exec to first token (wall, and the CPU seconds its process tree spent by
then: the steadier number on a shared machine), llama-server's exec to first token in the same
run, and what a KV pool costs to allocate (lazily committed) against touching all of it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and every live descendant (/proc), reaped ones
    included through their parents' cutime / cstime."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _until(first_token: Callable[[], None], proc: subprocess.Popen, timeout_s: float,
           started: float) -> dict[str, float]:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            first_token()
            return {"wall_s": time.monotonic() - started, "cpu_s": tree_cpu_s(proc.pid)}
        except Exception:  # not up yet: refused, UNAVAILABLE, 503 while loading
            if time.monotonic() - started > timeout_s:
                raise
            time.sleep(0.02)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# Lines of `tessera serve`'s output that mark its start's phases (the log's JSON "event", or
# the start of a printed line), in the order they come.
_SERVE_MARKS = (("gateway_up", "tessera gateway on "), ("template_ready", "worker template ready"),
                ("worker_ready", "worker ready"))


def _own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` itself (NaN once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return float("nan")
    return sum(int(x) for x in fields[11:13]) / _TICK


def _start_tick(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat's starttime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError):
        return None


class _ServeLog:
    """Reads a `tessera serve` process's output as it comes and notes, for each of its start's
    marks, when it came (seconds since `started`) and the gateway process's own CPU seconds
    then; the template's pid, CPU seconds at its ready and its reported load phases."""

    def __init__(self, proc: subprocess.Popen, started: float) -> None:
        self.proc, self.started = proc, started
        self.marks: dict[str, float] = {}
        self.gateway_cpu: dict[str, float] = {}
        self.template: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.monotonic() - self.started
            line = raw.decode(errors="replace").strip()
            event = line
            if line.startswith("{"):
                try:
                    message = json.loads(line)
                except ValueError:
                    message = {}
                event = str(message.get("event", ""))
                if event == "worker template ready":
                    pid = int(message.get("pid", 0))
                    self.template = {"pid": pid, "cpu_at_ready_s": _own_cpu_s(pid),
                                     "phases_s": message.get("phases", {})}
            for name, prefix in _SERVE_MARKS:
                if name not in self.marks and event.startswith(prefix):
                    self.marks[name] = round(now, 4)
                    self.gateway_cpu[name] = _own_cpu_s(self.proc.pid)

    def phases(self, first_token_s: float) -> dict[str, Any]:
        """serve exec -> template launched -> gateway up -> template ready -> worker ready ->
        first token: each mark's seconds since exec, and the gateway's own CPU at each."""
        marks = dict(self.marks)
        pid = self.template.get("pid")
        serve_tick = _start_tick(self.proc.pid)
        template_tick = None if pid is None else _start_tick(pid)
        if serve_tick is not None and template_tick is not None:  # 10 ms steps
            marks["template_launched"] = (template_tick - serve_tick) / _TICK
        marks["first_token"] = round(first_token_s, 4)
        order = ("template_launched", "gateway_up", "template_ready", "worker_ready",
                 "first_token")
        self.gateway_cpu["first_token"] = _own_cpu_s(self.proc.pid)
        return {"marks_s": {k: marks[k] for k in order if k in marks},
                "gateway_cpu_s": self.gateway_cpu,
                "template_cpu_at_ready_s": self.template.get("cpu_at_ready_s"),
                "template_phases_s": self.template.get("phases_s", {})}


def serve_start(template: bool, first_token: Callable[[str], None], key: str, model: str,
                kv_bytes: int, timeout_s: float = 600,
                root: str | None = None) -> dict[str, Any]:
    """`tessera serve` (one worker at start; a pool that can grow, so with a template unless
    `template` is False) from exec until `first_token(target)` returns, and its start by phase
    (_ServeLog.phases). `root`: the checkout to run it from (None: this one's PYTHONPATH)."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        f.write(f"{key}=bench\n")
    cmd = [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(port),
           "--api-keys", f.name, "--model-id", model, "--min-workers", "1",
           "--max-workers", "2" if template else "1", "--worker-threads", "1",
           "--kv-cache-bytes", str(kv_bytes), "--no-http"]
    if not template:
        cmd.append("--no-worker-template")
    env = None if root is None else {**os.environ, "PYTHONPATH": root}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=root)
    log = _ServeLog(proc, started)

    def attempt() -> None:
        # NOTE: a plain TCP connect first, so no gRPC attempt is refused: a refused one leaves
        # the target's shared subchannel failing (and backing off) for a while after the port
        # opens, a delay that would be counted as serve's start
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        first_token(f"127.0.0.1:{port}")

    try:
        out: dict[str, Any] = _until(attempt, proc, timeout_s, started)
        out.update(log.phases(out["wall_s"]))
        return out
    finally:
        _stop(proc)
        os.unlink(f.name)


def llama_server_start(binary: str, gguf: str, prompt: str,
                       timeout_s: float = 600) -> dict[str, float]:
    """llama-server (2 threads, as many as tessera's host cores here) from exec until its
    /completion answers one token of `prompt`."""
    if not Path(binary).is_file():
        raise FileNotFoundError(f"no llama-server at {binary}")
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "-c", "512", "-np", "1"]
    body = json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0.0}).encode()

    def first_token() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            if resp.status != 200:
                raise urllib.error.HTTPError(req.full_url, resp.status, "", resp.headers, None)
            json.loads(resp.read())

    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return _until(first_token, proc, timeout_s, started)
    finally:
        _stop(proc)


def kv_pool_cost(nbytes: int) -> dict[str, float]:
    """Seconds to allocate a CPU KV pool of `nbytes` as the engine does (CPUPlatform.zeros: a
    private anonymous mapping, committed page by page on first write), and to touch all of it
    (what an eagerly zeroed pool would cost)."""
    import torch

    from runtime.platform import PLATFORMS

    t = time.perf_counter()
    pool = PLATFORMS["cpu"].zeros((nbytes,), torch.uint8, torch.device("cpu"))
    allocated = time.perf_counter() - t
    t = time.perf_counter()
    pool.view(-1)[::4096] = 1
    touched = time.perf_counter() - t
    return {"allocate_s": allocated, "touch_all_s": touched}
