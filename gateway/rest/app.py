"""The ASGI app of the REST shim: OpenAI-compatible and Workers-AI-style routes over the
gateway's SDK, errors in each API's own envelope, the status endpoint (behind the operator key)
and the status page."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from gateway.errors import Internal, Unauthenticated
from gateway.rest import openai_api, workers_ai
from gateway.rest.docs import install_docs
from gateway.rest.drain import Drain
from gateway.rest.errors import ShimError, error_response
from gateway.rest.guard import (
    API_PREFIXES,
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    Guard,
    wants_workers_ai,
)
from gateway.rest.schemas import RUN_TAGS
from gateway.rest.status import GatewayView, ShimStats, route_of
from gateway.rest.upstream import MAX_API_KEY_BYTES, Upstream
from gateway.wire import MAX_NAME_BYTES
from runtime.errors import TesseraError, bounded
from runtime.structured_output import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS
from runtime.tool_grammar import MAX_TOOL_CALL_SPEC_CHARS

STATIC = Path(__file__).parent / "static"
_HTTP_REASONS = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 408: "REQUEST_TIMEOUT",
                 413: "REQUEST_TOO_LARGE"}
DESCRIPTION = f"""OpenAI-compatible and Workers-AI-style HTTP APIs of tessera, a client of its
gRPC gateway: `Authorization: Bearer <api key>` and `x-session-affinity` pass through.

Headers: the API key and `x-session-affinity` are printable ASCII of at most
{MAX_API_KEY_BYTES} and {MAX_NAME_BYTES} bytes (else 401 and 400), and all headers together
at most {MAX_HEADER_BYTES} bytes (else 431). Bodies are JSON whatever their content-type, at
most the size limit (else 413), and must keep arriving (408 after {BODY_TIMEOUT_S:g} s without
a byte, by default). Bodies are strict: unknown fields and mistyped values are refused with 400
(no coercion of `"0.5"` to a number, and integers are written as such: `2`, not `2.0`), strings
must be valid UTF-8 (no lone surrogates); OpenAI fields tessera does not implement are
refused. `top_k` 0 and -1 both mean off. `max_tokens` and `max_completion_tokens`, when both are
given, must agree. `n` candidates (1-16; candidate i samples with `seed` + i) share the prompt's
KV pages; usage counts the prompt once and every candidate's tokens, and streamed chunks name
their choice's `index`. `logprobs` (chat: `top_logprobs` 0-20 with `logprobs: true`;
completions: 0-20) are of the model's raw distribution, before penalties and temperature.
`min_tokens` (vLLM's) holds off EOS, stop token ids and stop strings. `/v1/completions` takes
up to 16 prompts; choice k * n + i is prompt k's candidate i. `role: "tool"` messages need a
`tool_call_id`; only `assistant` messages carry `tool_calls`. Tools are offered to the model in
the Hermes format (gateway/rest/tool_calls.py); `tool_choice` `required` or a named function,
and `response_format` `json_schema` (strict or not) and `json_object`, are enforced by
constrained decoding. `/ai/run` renders `prompt` through the model's chat template unless
`raw: true`. `/health` answers 200 while the gateway serves, else 503; `/docs` and `/redoc`
need no internet.

Refused for reasons this document cannot state (they depend on the model, the key or the
load): an unknown model (404) or one the key may not use (403); a prompt that does not fit the
model's context with `max_tokens` (400 `CONTEXT_LENGTH_EXCEEDED`, however large `max_tokens`
is); a prompt that is empty or
whose token ids are outside the model's vocabulary (400 `INVALID_ARGUMENT`, param `prompt`); a
conversation the model's chat template refuses (400); a `response_format` schema or a tool's
`parameters` that does not compile, is larger than {MAX_SPEC_CHARS} characters or nests more
than {MAX_SCHEMA_DEPTH} levels, tools whose parameters together pass
{MAX_TOOL_CALL_SPEC_CHARS} characters under a required tool call, a `strict: true` schema that
contradicts OpenAI's strict rules (`additionalProperties` other than false, a listed key not
required), tools with duplicate names, a `tool_choice` naming a function
not in `tools` or given without tools, a required tool call with a `response_format` (400
`INVALID_ARGUMENT`, param `response_format`, `tools`, `tool_choice` or `structured_output`,
the message naming the problem); a request that alone needs more KV than
its tenant may hold (429 `TENANT_QUOTA_EXCEEDED`, not to be retried); a key that already has
as many requests running and waiting as it may (429 `TENANT_CONCURRENCY_EXCEEDED` with
Retry-After); a `/v1/completions` prompt list longer than its key's `max_inflight +
max_queued` (400 `INVALID_ARGUMENT`, param `prompt`: it could never run within them); a
full server (429 with Retry-After); a server shutting down (503 `UNAVAILABLE`
with Retry-After).

Errors: OpenAI routes answer `{{"error": {{"message", "type", "code", "param", "reason"}}}}`,
`/ai/run` its envelope with `success: false`; the HTTP status follows the reason (400, 401,
403, 404, 408, 409 for a KV integrity abort, 413, 429 with Retry-After when retrying helps,
431, 503, 504). Non-streaming answers carry `x-tessera-served` (model, revision, weight/KV
formats per phase, worker); OpenAI bodies carry the same as `system_fingerprint`. `/status`
needs `Authorization: Bearer <operator key>`."""
MAX_FIELD_PART_CHARS = 64
MAX_ERRORS_SHOWN = 3
# NOTE: pydantic's messages for these context keys quote the input (a tag, an attribute, a
# parser's error); the errors our own validators raise (`value_error`) never do.
_ECHOING_CONTEXT = {"error", "tag", "attribute"}


def _field(error: dict[str, Any]) -> str:
    """Where an error is, as the client wrote it: without `body`, the /ai/run member's tag or
    pydantic's union labels (`function-after[...]`, `list[...]`), each part bounded."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[2:] if loc[1:2] and loc[1] in RUN_TAGS else loc[1:]
    parts = [str(p) for p in loc if not (isinstance(p, str) and "[" in p)]
    return ".".join(bounded(p, MAX_FIELD_PART_CHARS) for p in parts)


def _message(error: dict[str, Any]) -> str:
    if error.get("type") != "value_error" and _ECHOING_CONTEXT & set(error.get("ctx") or {}):
        return "invalid value"
    return str(error.get("msg", "invalid value"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A bounded message that names fields but never echoes a value the client sent."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "malformed JSON body", None
    text = "; ".join(f"{_field(e) or 'body'}: {_message(e)}" for e in errors[:MAX_ERRORS_SHOWN])
    more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN \
        else ""
    return f"invalid request: {text}{more}", (_field(errors[0]) if errors else "") or None


def _refused(request: Request, error: TesseraError) -> Response:
    """The error's response, the request counted by its reason unless a relay counted it."""
    if not getattr(request.state, "recorded", False):
        stats: ShimStats = request.app.state.stats
        stats.record(route_of(request.url.path), error.reason, None)
    return error_response(error, wants_workers_ai(request.url.path))


def _install_error_handlers(app: FastAPI) -> None:
    async def tessera(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, TesseraError)
        return _refused(request, exc)

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, field = _validation_message(exc)
        error = ShimError("INVALID_ARGUMENT", message, **({"field": field} if field else {}))
        return _refused(request, error)

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        reason = _HTTP_REASONS.get(exc.status_code, "INVALID_ARGUMENT")
        response = _refused(request, ShimError(reason, str(exc.detail)))
        response.headers.update(exc.headers or {})
        return response

    async def internal(request: Request, exc: Exception) -> Response:  # never a traceback
        return _refused(request, Internal(f"internal error: {type(exc).__name__}"))

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
                elif path == "/status":
                    op["security"] = [{"operator": []}]
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "an API key"},
            "operator": {"type": "http", "scheme": "bearer", "description": "the operator key"}}
        app.openapi_schema = doc
    return app.openapi_schema


def _operator(request: Request) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key: str = request.app.state.operator_key
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise Unauthenticated("`/status` needs `Authorization: Bearer <operator key>`")


def build_app(upstream: Upstream, view: GatewayView | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, *, operator_key: str | None = None,
              body_timeout_s: float = BODY_TIMEOUT_S, drain: Drain | None = None) -> FastAPI:
    """`operator_key` opens `/status`; without one, a random key nobody knows keeps it shut."""
    app = FastAPI(title="tessera REST shim", version="1", description=DESCRIPTION,
                  docs_url=None, redoc_url=None)
    app.state.upstream, app.state.stats, app.state.view = upstream, ShimStats(), view
    app.state.operator_key = operator_key or secrets.token_urlsafe(32)
    app.state.drain = drain = drain or Drain()
    app.include_router(openai_api.router)
    app.include_router(workers_ai.router)
    install_docs(app)
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/status", tags=["status"], dependencies=[Depends(_operator)],
             responses={401: {"description": "no or wrong operator key"}})
    async def status(request: Request) -> dict[str, Any]:
        """The status page's data: this shim's counts and, in the gateway's process, pools and
        workers (with their PIDs): for operators only."""
        view: GatewayView | None = request.app.state.view
        return {"gateway_target": upstream.target,
                "shim": request.app.state.stats.snapshot(),
                "gateway": None if view is None else await view.snapshot()}

    @app.get("/health", tags=["status"], responses={503: {"description": "not serving"}})
    async def health(request: Request) -> Response:
        """Liveness and readiness on the API port: 200 `{"status": "ok"}` while this shim
        takes requests and its gateway reports SERVING (gRPC health), else 503."""
        ok = not request.app.state.drain.draining and await upstream.serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/status.js", include_in_schema=False)
    async def script() -> FileResponse:
        return FileResponse(STATIC / "status.js", media_type="text/javascript")

    app.add_middleware(Guard, drain=drain, max_body_bytes=max_body_bytes,  # type: ignore[arg-type]
                       body_timeout_s=body_timeout_s, stats=app.state.stats)
    return app
