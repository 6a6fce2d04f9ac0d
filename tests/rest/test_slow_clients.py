"""Slow or stuck clients hold nothing for long: a body that stops arriving is answered 408 in the
route's envelope and its connection closed, an idle keep-alive connection is closed, and
other requests are served meanwhile. Raw sockets play the stuck clients."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.rest.conftest import KEYS, MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
BODY_TIMEOUT_S = 1.0
SLACK_S = 3.0


def stalled(host: str, port: int, path: str) -> socket.socket:
    """Headers promising 1000 bytes of body, then 10 bytes, then nothing."""
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: tessera\r\ncontent-type: application/json\r\n"
                 f"authorization: Bearer {KEYS['acme']}\r\ncontent-length: 1000\r\n\r\n"
                 .encode() + b'{"prompt":')
    return sock


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)  # raises TimeoutError if the server keeps it open
        if not chunk:
            return data
        data += chunk


def test_stalled_bodies_are_answered_408_and_closed_while_others_are_served(shim) -> None:
    with shim.another_server(body_timeout_s=BODY_TIMEOUT_S) as server:
        paths = ["/v1/completions", f"/ai/run/{MODEL}"] * 10
        socks = [stalled(server.host, server.port, path) for path in paths]
        started = time.monotonic()
        r = httpx.post(f"{server.url}/ai/run/{MODEL}", json={"prompt": "Hi", "max_tokens": 2},
                       headers=shim.headers(), timeout=60)
        assert r.status_code == 200, r.text
        deadline = started + BODY_TIMEOUT_S + SLACK_S
        for sock, path in zip(socks, paths, strict=True):
            answer = read_until_closed(sock, deadline)
            sock.close()
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert b"connection: close" in answer.lower() and b"REQUEST_TIMEOUT" in answer
            assert (b'"success":false' in answer) == path.startswith("/ai/")
        print(f"20 stalled bodies closed {time.monotonic() - started:.2f} s after they stalled "
              f"(timeout {BODY_TIMEOUT_S} s)")


def test_idle_keep_alive_connection_is_closed(shim) -> None:
    with shim.another_server(keep_alive_s=1) as server:
        sock = socket.create_connection((server.host, server.port), timeout=30)
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nhost: tessera\r\n"
                     f"authorization: Bearer {KEYS['acme']}\r\n\r\n".encode())
        answer = read_until_closed(sock, time.monotonic() + 1 + SLACK_S)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and MODEL.encode() in answer
