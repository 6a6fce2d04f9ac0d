"""A client that goes away frees its request at once, on every route and in every phase: while
it waits for a worker, during prefill and mid-decode. The client is a raw socket closed at
the chosen moment; the worker must be back to idle within seconds, not after max_tokens."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.gateway.conftest import wait_for
from tests.rest.conftest import KEYS, MODEL, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}  # ~30 s of decode here
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Count to 1000."}],
                                   "model": MODEL, **LONG},
          "/v1/completions": {"prompt": "Count to 1000:", "model": MODEL, **LONG},
          f"/ai/run/{MODEL}": {"prompt": "Count to 1000:", **LONG}}
FREED_WITHIN_S = 5.0


def open_request(shim: Shim, path: str, body: dict) -> socket.socket:
    """A non-streaming request sent on a raw connection that the test closes when it likes."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: tessera\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEYS['acme']}\r\ncontent-length: {len(data)}\r\n\r\n")
    sock = socket.create_connection((shim.server.host, shim.server.port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def leave_when(shim: Shim, sock: socket.socket, moment: Callable[[], bool]) -> float:
    """Closes the connection once `moment()` holds; seconds until the worker is idle again."""
    wait_for(moment, 60, "the request to reach the chosen phase")
    sock.close()
    closed = time.monotonic()
    wait_for(shim.workers_idle, FREED_WITHIN_S, "the worker to be idle")
    return time.monotonic() - closed


def next_request_is_served(shim: Shim) -> None:
    r = httpx.post(f"{shim.url}/ai/run/{MODEL}", json={"prompt": "Hi", "max_tokens": 2},
                   headers=shim.headers(), timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", sorted(BODIES))
def test_client_gone_mid_decode_frees_the_request_at_once(shim, path) -> None:
    sock = open_request(shim, path, BODIES[path])
    started = time.monotonic()

    def decoding_for_a_second() -> bool:
        return shim.num_running() == 1 and time.monotonic() - started > 1.0

    freed_s = leave_when(shim, sock, decoding_for_a_second)
    print(f"{path}: freed {freed_s:.2f} s after the client left mid-decode")
    assert freed_s < FREED_WITHIN_S and shim.num_running() == 0
    next_request_is_served(shim)


def test_client_gone_during_prefill_frees_the_request_at_once(shim) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens of prefill
    sock = open_request(shim, "/v1/completions", {"prompt": prompt, "model": MODEL, **LONG,
                                                  "max_tokens": 64})
    freed_s = leave_when(shim, sock, lambda: shim.num_running() == 1)
    print(f"freed {freed_s:.2f} s after the client left as its prompt was admitted")
    assert freed_s < FREED_WITHIN_S and shim.num_running() == 0
    next_request_is_served(shim)


@pytest.fixture
def one_slot_taken(shim: Shim) -> Iterator[None]:
    with shim.only_slot_taken(max_queue=4):
        yield


def test_client_gone_before_admission_leaves_the_queue_at_once(shim, one_slot_taken) -> None:
    pool = shim.runner.gateway.pools[MODEL]
    stats = shim.server.app.state.stats
    cancelled = stats.requests[("ai.run", "CANCELLED")]
    sock = open_request(shim, f"/ai/run/{MODEL}", BODIES[f"/ai/run/{MODEL}"])
    wait_for(lambda: pool.waiting == 1, 30, "the request to queue")
    sock.close()
    closed = time.monotonic()
    wait_for(lambda: pool.waiting == 0, FREED_WITHIN_S, "the request to leave the queue")
    print(f"left the queue {time.monotonic() - closed:.2f} s after the client")
    assert stats.requests[("ai.run", "CANCELLED")] == cancelled + 1
    assert shim.num_running() == 1, "only the holder ran"
