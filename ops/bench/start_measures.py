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
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

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


def serve_start(template: bool, first_token: Callable[[str], None], key: str, model: str,
                kv_bytes: int, timeout_s: float = 600) -> dict[str, float]:
    """`tessera serve` (one worker at start; a pool that can grow, so with a template unless
    `template` is False) from exec until `first_token(target)` returns."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        f.write(f"{key}=bench\n")
    cmd = [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(port),
           "--api-keys", f.name, "--model-id", model, "--min-workers", "1",
           "--max-workers", "2" if template else "1", "--worker-threads", "1",
           "--kv-cache-bytes", str(kv_bytes), "--no-http"]
    if not template:
        cmd.append("--no-worker-template")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return _until(lambda: first_token(f"127.0.0.1:{port}"), proc, timeout_s, started)
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
