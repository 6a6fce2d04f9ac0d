"""Hosting the shim: uvicorn on an event loop that is already running (the gateway's, in
`tessera serve` and in tests), on a socket bound before start so port 0 works."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from gateway.rest.app import build_app
from gateway.rest.drain import Drain
from gateway.rest.guard import BODY_TIMEOUT_S, MAX_BODY_BYTES
from gateway.rest.status import GatewayView
from gateway.rest.upstream import Upstream

KEEP_ALIVE_S = 5  # uvicorn's and vLLM's: an idle connection holds a socket, nothing more
MAX_CONNECTIONS = 1024  # beyond it, uvicorn answers 503 (and the gateway's own queue is smaller)
# NOTE: h11 buffers at most this much of a request's head; up to it the Guard answers a typed
# 400 / 401 / 431, past it uvicorn's plain 400.
MAX_REQUEST_HEAD_BYTES = 256 << 10
ENDING_S = 2.0  # for requests ended by stop() to write their errors


class RestServer:
    def __init__(self, gateway_target: str, host: str = "127.0.0.1", port: int = 8000, *,
                 view: GatewayView | None = None, operator_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
                 keep_alive_s: int = KEEP_ALIVE_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        """`operator_key` opens `/status` (and the page at `/#key=...`); None: a random one,
        read it from `operator_key`."""
        self.upstream = Upstream(gateway_target)
        self.drain = Drain()
        self.app = build_app(self.upstream, view, max_body_bytes, operator_key=operator_key,
                             body_timeout_s=body_timeout_s, drain=self.drain)
        self.operator_key: str = self.app.state.operator_key
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                http="h11", timeout_keep_alive=keep_alive_s,
                                limit_concurrency=max_connections,
                                h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
                                timeout_graceful_shutdown=int(ENDING_S))
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[Any] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> RestServer:
        """Call on the loop that will serve it; returns once the socket accepts."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        return self

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting connections; answer new API requests with 503 UNAVAILABLE; let the
        requests in flight finish for up to grace_s, then end what is left with UNAVAILABLE in
        its own protocol's shape (a JSON error body, or an error event ending the stream)."""
        self.drain.draining = True
        for server in self._server.servers:
            server.close()
        if not await self.drain.wait_idle(grace_s):
            self.drain.end()
            await self.drain.wait_idle(ENDING_S)
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self.upstream.close()
        self._sock.close()
