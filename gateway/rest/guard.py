"""The shim's edge, before any parsing: API requests are refused while the server drains, need
a well-formed bearer token, and have bounded headers, a bounded body and a body that keeps
arriving. Each refusal is typed and in the route's own envelope."""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.rest.drain import Drain, shutting_down
from gateway.rest.errors import ShimError, error_response
from gateway.rest.status import ShimStats, route_of
from gateway.rest.upstream import bearer_token, session_id
from runtime.errors import TesseraError

API_PREFIXES = ("/v1/", "/ai/")
MAX_BODY_BYTES = 1 << 20
MAX_HEADER_BYTES = 32 << 10
BODY_TIMEOUT_S = 10.0
CLOSE = {"connection": "close"}


def wants_workers_ai(path: str) -> bool:
    return path.startswith("/ai/")


def _content_length(headers: Headers) -> int:
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else 0


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"request body not received: nothing arrived for {timeout_s:g} s",
                         headers=CLOSE)


class Guard:
    def __init__(self, app: ASGIApp, drain: Drain, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S,
                 max_header_bytes: int = MAX_HEADER_BYTES, stats: ShimStats | None = None) -> None:
        self.app, self.drain = app, drain
        self.stats = stats or ShimStats()
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.max_header_bytes = max_header_bytes

    def refusal(self, scope: Scope) -> TesseraError | None:
        """Why this request is refused before its body is read, if it is. The order is fixed,
        so one header's size never changes the error another header gets."""
        if self.drain.draining:
            return shutting_down()
        headers = Headers(scope=scope)
        try:
            bearer_token(headers)
            session_id(headers)
        except TesseraError as e:
            return e
        header_bytes = sum(len(k) + len(v) for k, v in scope["headers"])
        if header_bytes > self.max_header_bytes:
            return ShimError("REQUEST_HEADER_FIELDS_TOO_LARGE", f"request headers over the limit "
                             f"of {self.max_header_bytes} bytes", limit=self.max_header_bytes)
        if _content_length(headers) > self.max_body_bytes:
            return ShimError("REQUEST_TOO_LARGE", f"request body over the limit of "
                             f"{self.max_body_bytes} bytes", limit=self.max_body_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API_PREFIXES):
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            self.stats.record(route_of(path), refusal.reason, None)
            response = error_response(refusal, wants_workers_ai(path))
            if self.drain.draining:
                response.headers.update(CLOSE)
            return await response(scope, receive, send)
        # NOTE: bodies are JSON whatever the content-type says: `curl -d '{...}'` sends a form
        # type, and Workers AI's and OpenAI's own examples rely on that working.
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                      if k.lower() != b"content-type"]
                 + [(b"content-type", b"application/json")],
                 "state": dict(scope.get("state") or {})}  # request.state: `recorded` below
        with self.drain.request():
            await self._serve(scope, self._bounded(receive), send)

    def _bounded(self, receive: Receive) -> Receive:
        """receive, refusing a body over the limit (chunked bodies have no content-length) or
        one that stops arriving; once the body is complete, it waits as long as it takes."""
        received, complete = 0, False

        async def bounded() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            received += len(message.get("body", b""))
            complete = message["type"] != "http.request" or not message.get("more_body")
            if received > self.max_body_bytes:
                raise BodyTooLarge()
            return message

        return bounded

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            # uvicorn cancels what is left when its graceful shutdown times out: answer in the
            # route's envelope rather than with its text/plain 500, and end here.
            if started:
                raise
            error = shutting_down()
            if not scope["state"].get("recorded"):  # a relay counts what it relayed
                self.stats.record(route_of(scope["path"]), error.reason, None)
            response = error_response(error, wants_workers_ai(scope["path"]))
            response.headers.update(CLOSE)
            await response(scope, receive, send)
