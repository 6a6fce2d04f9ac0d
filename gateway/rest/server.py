"""Hosting the shim: uvicorn on an event loop that is already running (the gateway's, in
`tessera serve` and in tests), on a socket bound before start so port 0 works."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

import uvicorn

from gateway.rest.app import MAX_BODY_BYTES, build_app
from gateway.rest.status import GatewayView
from gateway.rest.upstream import Upstream

if TYPE_CHECKING:
    from gateway.serve import GatewayRunner


class RestServer:
    def __init__(self, gateway_target: str, host: str = "127.0.0.1", port: int = 8000, *,
                 view: GatewayView | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.upstream = Upstream(gateway_target)
        self.app = build_app(self.upstream, view, max_body_bytes)
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=2)
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

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self.upstream.close()
        self._sock.close()


def serve_rest(runner: GatewayRunner, host: str = "127.0.0.1", port: int = 8000) -> RestServer:
    """The shim on a started GatewayRunner's event loop, its status page reading that gateway."""
    assert runner.gateway is not None, "start the runner first"
    server = RestServer(runner.target, host, port,
                        view=GatewayView(runner.gateway, runner.loop))
    return runner.call(server.start())
