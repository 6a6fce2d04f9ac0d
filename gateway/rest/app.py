"""The ASGI app of the REST shim: OpenAI-compatible and Workers-AI-style routes over the
gateway's SDK, errors in each API's own envelope, a JSON status endpoint and the status page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Internal, Unauthenticated
from gateway.rest import openai_api, workers_ai
from gateway.rest.errors import ShimError, error_response
from gateway.rest.status import GatewayView, ShimStats
from gateway.rest.upstream import Upstream
from runtime.errors import TesseraError

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20
API_PREFIXES = ("/v1/", "/ai/")
_HTTP_REASONS = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "REQUEST_TOO_LARGE"}
DESCRIPTION = """OpenAI-compatible and Workers-AI-style HTTP APIs of tessera, a client of its
gRPC gateway: `Authorization: Bearer <api key>` and `x-session-affinity` pass through.
Bodies are JSON whatever their content-type, and strict: unknown fields and mistyped values are
refused with 400 (no coercion of `"0.5"` to a number); OpenAI fields tessera does not implement
are accepted only at their neutral value (`n: 1`). Bodies over the size limit get 413.
Errors: OpenAI routes answer `{"error": {"message", "type", "code", "param", "reason"}}`,
`/ai/run` its envelope with `success: false`; the HTTP status follows the reason (400, 401,
403, 404, 409 for a KV integrity abort, 413, 429 with Retry-After when retrying helps, 503,
504). Non-streaming answers carry `x-tessera-served` (model, revision, weight/KV formats per
phase, worker); OpenAI bodies carry the same as `system_fingerprint`."""


def _wants_workers_ai(path: str) -> bool:
    return path.startswith("/ai/")


def _content_length(headers: dict[str, str]) -> int:
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else 0


class _TooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


class Guard:
    """Before any parsing: API routes need a bearer token, and bodies stay under the limit."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(API_PREFIXES):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal: TesseraError | None = None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            refusal = Unauthenticated("missing `Authorization: Bearer <api key>` header")
        elif _content_length(headers) > self.max_body_bytes:
            refusal = ShimError("REQUEST_TOO_LARGE", f"request body over the limit of "
                                f"{self.max_body_bytes} bytes", limit=self.max_body_bytes)
        if refusal is not None:
            return await error_response(refusal, _wants_workers_ai(path))(scope, receive, send)
        # NOTE: bodies are JSON whatever the content-type says: `curl -d '{...}'` sends a form
        # type, and Workers AI's and OpenAI's own examples rely on that working.
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                      if k.lower() != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        received = 0

        async def limited() -> Any:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # chunked bodies have no content-length
                raise _TooLarge()
            return message

        await self.app(scope, limited, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "malformed JSON body", None
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    text = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                     f"{e.get('msg', 'invalid')}" for e in errors[:5])
    return f"invalid request: {text}", field


def _install_error_handlers(app: FastAPI) -> None:
    async def tessera(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, TesseraError)
        return error_response(exc, _wants_workers_ai(request.url.path))

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, field = _validation_message(exc)
        error = ShimError("INVALID_ARGUMENT", message, **({"field": field} if field else {}))
        return error_response(error, _wants_workers_ai(request.url.path))

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        reason = _HTTP_REASONS.get(exc.status_code, "INVALID_ARGUMENT")
        error = ShimError(reason, str(exc.detail))
        response = error_response(error, _wants_workers_ai(request.url.path))
        response.headers.update(exc.headers or {})
        return response

    async def internal(request: Request, exc: Exception) -> Response:  # never a traceback
        return error_response(Internal(f"internal error: {type(exc).__name__}"),
                              _wants_workers_ai(request.url.path))

    app.add_exception_handler(TesseraError, tessera)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, internal)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, made true: 400 (not 422) for bad bodies, bearer auth declared."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)
        for path, ops in doc["paths"].items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if path.startswith(API_PREFIXES):
                    op["security"] = [{"bearer": []}]
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
    return app.openapi_schema


def build_app(upstream: Upstream, view: GatewayView | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="tessera REST shim", version="1", description=DESCRIPTION)
    app.state.upstream, app.state.stats, app.state.view = upstream, ShimStats(), view
    app.include_router(openai_api.router)
    app.include_router(workers_ai.router)
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/status", tags=["status"])
    async def status(request: Request) -> dict[str, Any]:
        """The status page's data: this shim's counts and, in the gateway's process, pools."""
        view: GatewayView | None = request.app.state.view
        return {"gateway_target": upstream.target,
                "shim": request.app.state.stats.snapshot(),
                "gateway": None if view is None else await view.snapshot()}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/status.js", include_in_schema=False)
    async def script() -> FileResponse:
        return FileResponse(STATIC / "status.js", media_type="text/javascript")

    app.add_middleware(Guard, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    return app
