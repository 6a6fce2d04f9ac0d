"""Headless Debian chromium driven over the DevTools protocol (a websocket, no browser download):
installed with apt-get when missing, one fresh profile per run."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900")


def find_or_install_chromium(timeout_s: float = 600) -> str | None:
    """The chromium binary, installing Debian's package first if needed; None if impossible."""
    found = shutil.which("chromium")
    if found or shutil.which("apt-get") is None:
        return found
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        if subprocess.run(cmd, env=env, capture_output=True, timeout=timeout_s).returncode:
            return None
    return shutil.which("chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="tessera-chromium-")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}",
             f"--remote-debugging-port={self.port}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(self._page_socket(), max_size=None))
        self._ids = itertools.count(1)

    def _page_socket(self, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=2).json()
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise TimeoutError("chromium's DevTools endpoint did not come up")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        ws: ClientConnection = self.ws
        msg_id = next(self._ids)
        ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(ws.recv(timeout=60))
            if reply.get("id") == msg_id:  # events in between are not needed here
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"page never satisfied: {expression}")

    def navigate(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)
