"""The first-request smoke test a new user's machine passes after `bash ops/install.sh`:
`python3 -m ops.smoke` starts `tessera serve` on free ports, gets one chat answer over REST and
one generate over gRPC (the SDK), runs `tessera bench serve` for a few requests, and stops the
server. Any failed step ends the run with exit status 1 and one line saying which; the server is
always stopped. `.ci/run` runs it before the suite."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gateway.client import Client


class SmokeFailed(Exception):
    """One step failed; the message says which and why."""


def say(text: str) -> None:
    """One line to stdout in one write, so the server's relayed lines never split it."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`tessera serve` as a subprocess, its output kept (and echoed) line by line."""

    def __init__(self, grpc_port: int, http_port: int, tmp: Path, start_timeout_s: float) -> None:
        self.grpc_port, self.http_port = grpc_port, http_port
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["tessera", "serve", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
             "--shutdown-grace-s", "5", "--worker-start-timeout-s", str(start_timeout_s)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            say(f"  serve| {self.lines[-1]}")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise SmokeFailed(f"tessera serve exited {self.proc.returncode} before "
                                  f"printing {pattern!r}")
            if time.monotonic() > deadline:
                raise SmokeFailed(f"tessera serve printed no {pattern!r} in {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM (a drain), then SIGKILL to its whole group if it outlives timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise SmokeFailed(f"tessera serve did not stop within {timeout_s:.0f} s "
                                  "of SIGTERM") from None
        return self.proc.returncode


def rest_chat(http_port: int, key: str) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body, method="POST",
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.load(resp)
    text = answer["choices"][0]["message"]["content"]
    if not text:
        raise SmokeFailed(f"REST chat answered no text: {answer}")
    return text


def grpc_generate(grpc_port: int, key: str) -> str:
    with Client(f"127.0.0.1:{grpc_port}", api_key=key) as client:
        stream = client.generate("The capital of France is", max_tokens=16)
        text = "".join(c.text for c in stream)
    if not text:
        raise SmokeFailed("gRPC generate returned no text")
    return text


def bench_serve(grpc_port: int, key: str, out: Path) -> str:
    proc = subprocess.run(
        ["tessera", "bench", "serve", "--target", f"127.0.0.1:{grpc_port}", "--api-key", key,
         "--num-prompts", "4", "--concurrency", "2", "--input-len", "16", "--output-len", "8",
         "--out", str(out)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SmokeFailed(f"tessera bench serve exited {proc.returncode}: {tail}")
    return f"results in {out.name}"


def step(name: str, fn, *args) -> object:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        result = fn(*args)
    except SmokeFailed:
        raise
    except Exception as e:  # any other failure of a step is that step's failure
        raise SmokeFailed(f"{name}: {type(e).__name__}: {e}") from e
    say(f"smoke: {name} ok ({time.monotonic() - start:.1f} s): {result!r}"[:300])
    return result


def run(start_timeout_s: float) -> None:
    with tempfile.TemporaryDirectory(prefix="tessera-smoke-") as tmp:
        server = Server(free_port(), free_port(), Path(tmp), start_timeout_s)
        try:
            key = server.wait_for(r"dev API key \(tenant 'dev'\): (\S+)", start_timeout_s)[1]
            server.wait_for(r"^call it:", start_timeout_s)
            step("REST chat", rest_chat, server.http_port, key)
            step("gRPC generate", grpc_generate, server.grpc_port, key)
            step("tessera bench serve", bench_serve, server.grpc_port, key,
                 Path(tmp) / "serve.json")
        finally:
            code = server.stop()
        if code != 0:
            raise SmokeFailed(f"tessera serve exited {code} after SIGTERM (expected 0)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start-timeout-s", type=float, default=600,
                    help="how long `tessera serve` may take to print that its workers are ready")
    args = ap.parse_args(argv)
    try:
        run(args.start_timeout_s)
    except SmokeFailed as e:
        print(f"smoke FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    say("smoke: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
