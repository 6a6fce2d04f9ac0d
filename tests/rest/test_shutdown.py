"""RestServer.stop(grace_s): no new connections; new API requests get 503 UNAVAILABLE (retry
elsewhere); requests in flight finish within the grace period, and what is left then ends with
a typed error in its protocol's own shape: a 503 JSON body of the route's envelope, or an error
event closing the stream. Each test stops a second shim on the shared gateway."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.rest import RestServer
from tests.gateway.conftest import wait_for
from tests.rest.conftest import MODEL, Shim
from tests.rest.test_slow_clients import read_until_closed, stalled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CHAT = "/v1/chat/completions"
RUN = f"/ai/run/{MODEL}"
# Two tenants, two requests each: all four fit their tenant's KV quota and run at once, and
# decode well past a 3 s grace period (200 tokens took 2.8 s once the int8 kernels got faster).
LONG = {"max_tokens": 500, "ignore_eos": True, "temperature": 0}


def chat(stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Count."}], "model": MODEL,
            "stream": stream, **LONG}


def run(stream: bool) -> dict[str, Any]:
    return {"prompt": "Count:", "stream": stream, **LONG}


def post(shim: Shim, server: RestServer, path: str, body: dict[str, Any],
         tenant: str) -> httpx.Response:
    """The whole response, streamed or not (httpx reads it to the end)."""
    return httpx.post(server.url + path, json=body, headers=shim.headers(tenant), timeout=120)


def last_event(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert events[-1] != "[DONE]", "ended by the server, not finished"
    return json.loads(events[-1])


def stop(shim: Shim, server: RestServer, grace_s: float) -> Future[None]:
    return asyncio.run_coroutine_threadsafe(server.stop(grace_s=grace_s), shim.runner.loop)


def in_flight(pool: ThreadPoolExecutor, calls: list[Callable[[], httpx.Response]],
              shim: Shim) -> list[Future[httpx.Response]]:
    futures = [pool.submit(call) for call in calls]
    wait_for(lambda: shim.num_running() == len(calls), 60, "every request to be decoding")
    return futures


def test_requests_left_after_the_grace_period_end_in_their_own_shape(shim) -> None:
    with shim.another_server() as server, ThreadPoolExecutor(4) as pool, \
            httpx.Client(headers=shim.headers(), timeout=60) as kept_alive:
        assert kept_alive.get(f"{server.url}/v1/models").status_code == 200
        futures = in_flight(pool, [
            lambda: post(shim, server, CHAT, chat(stream=False), "acme"),
            lambda: post(shim, server, RUN, run(stream=False), "acme"),
            lambda: post(shim, server, CHAT, chat(stream=True), "bob"),
            lambda: post(shim, server, RUN, run(stream=True), "bob")], shim)
        started = time.monotonic()
        stopped = stop(shim, server, grace_s=3.0)
        wait_for(lambda: server.drain.draining, 10, "the drain to begin")

        r = kept_alive.post(f"{server.url}{RUN}", json=run(stream=False))
        assert r.status_code == 503 and r.json()["errors"][0]["reason"] == "UNAVAILABLE"
        assert r.headers["x-should-retry"] == "true" and int(r.headers["retry-after"]) >= 1
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/v1/models", headers=shim.headers(), timeout=10)

        chat_json, run_json, chat_sse, run_sse = (f.result(timeout=60) for f in futures)
        stopped.result(timeout=30)
        print(f"stopped {time.monotonic() - started:.2f} s after stop(grace_s=3)")
        assert chat_json.status_code == 503 and chat_json.json()["error"]["reason"] == \
            "UNAVAILABLE" and chat_json.headers["x-should-retry"] == "true"
        assert run_json.status_code == 503 and run_json.json()["success"] is False
        assert run_json.json()["errors"][0]["reason"] == "UNAVAILABLE"
        assert last_event(chat_sse)["error"]["reason"] == "UNAVAILABLE"
        assert last_event(run_sse)["errors"][0]["reason"] == "UNAVAILABLE"
        wait_for(shim.workers_idle, 5, "the ended requests to free their pages")


def test_requests_in_flight_finish_within_the_grace_period(shim) -> None:
    with shim.another_server() as server, ThreadPoolExecutor(2) as pool:
        short = {**LONG, "max_tokens": 24}
        futures = in_flight(pool, [
            lambda: post(shim, server, CHAT, {**chat(stream=False), **short}, "acme"),
            lambda: post(shim, server, RUN, {**run(stream=True), **short}, "bob")], shim)
        started = time.monotonic()
        stop(shim, server, grace_s=60).result(timeout=90)
        print(f"stopped {time.monotonic() - started:.2f} s after stop(grace_s=60), "
              "once its requests were done")
        whole, streamed = (f.result(timeout=10) for f in futures)
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 24
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


def test_a_request_still_sending_its_body_at_the_end_gets_a_typed_503(shim) -> None:
    with shim.another_server() as server:
        sock = stalled(server.host, server.port, CHAT)
        wait_for(lambda: server.drain.num_in_flight == 1, 10, "the request to arrive")
        stop(shim, server, grace_s=0).result(timeout=30)
        answer = read_until_closed(sock, time.monotonic() + 10)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"reason":"UNAVAILABLE"' in answer
