"""Typed errors over HTTP: one table from reason to HTTP status, OpenAI type/code and Workers-AI
code, and the two error bodies (OpenAI's `{"error": ...}`, Workers AI's envelope)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from gateway.errors import retry_delay_s
from runtime.errors import TesseraError


@dataclass(frozen=True)
class HttpError:
    status: int
    openai_type: str
    openai_code: str
    workers_ai_code: int


# NOTE: 429 TENANT_QUOTA_EXCEEDED is never retryable (the request alone needs more KV than the
# tenant may hold), so it carries no Retry-After and `x-should-retry: false`; 429
# TENANT_CONCURRENCY_EXCEEDED (the key has as many requests running and waiting as it may) and
# OVERLOADED are, with Retry-After.
HTTP_ERRORS: dict[str, HttpError] = {
    "INVALID_ARGUMENT": HttpError(400, "invalid_request_error", "invalid_argument", 5006),
    "CONTEXT_LENGTH_EXCEEDED": HttpError(400, "invalid_request_error",
                                         "context_length_exceeded", 5021),
    "REQUEST_TIMEOUT": HttpError(408, "invalid_request_error", "request_timeout", 5012),
    "REQUEST_TOO_LARGE": HttpError(413, "invalid_request_error", "request_too_large", 5013),
    "REQUEST_HEADER_FIELDS_TOO_LARGE": HttpError(431, "invalid_request_error",
                                                 "request_header_fields_too_large", 5014),
    "UNAUTHENTICATED": HttpError(401, "authentication_error", "invalid_api_key", 10000),
    "PERMISSION_DENIED": HttpError(403, "permission_error", "permission_denied", 10001),
    "MODEL_NOT_FOUND": HttpError(404, "invalid_request_error", "model_not_found", 5007),
    "NOT_FOUND": HttpError(404, "invalid_request_error", "not_found", 7000),
    "METHOD_NOT_ALLOWED": HttpError(405, "invalid_request_error", "method_not_allowed", 7001),
    "KV_INTEGRITY_VIOLATION": HttpError(409, "integrity_error", "kv_integrity_violation", 3050),
    "OVERLOADED": HttpError(429, "rate_limit_error", "overloaded", 3040),
    "TENANT_QUOTA_EXCEEDED": HttpError(429, "rate_limit_error", "insufficient_quota", 3036),
    "TENANT_CONCURRENCY_EXCEEDED": HttpError(429, "rate_limit_error", "rate_limit_exceeded",
                                             3037),
    "CANCELLED": HttpError(499, "request_cancelled", "cancelled", 3008),
    "INTERNAL": HttpError(500, "server_error", "internal", 3000),
    "MODEL_LOAD_FAILED": HttpError(503, "server_error", "model_load_failed", 3043),
    "WORKER_LOST": HttpError(503, "server_error", "worker_lost", 3041),
    "WORKER_START_FAILED": HttpError(503, "server_error", "worker_start_failed", 3044),
    "UNAVAILABLE": HttpError(503, "server_error", "unavailable", 3042),
    "DEADLINE_EXCEEDED": HttpError(504, "timeout_error", "deadline_exceeded", 3007),
}


class ShimError(TesseraError):
    """A failure found by the shim itself (HTTP-only reasons such as REQUEST_TOO_LARGE)."""

    def __init__(self, reason: str, message: str, **metadata: Any) -> None:
        super().__init__(message, **metadata)
        self.reason = reason  # type: ignore[misc]


def http_error(reason: str) -> HttpError:
    return HTTP_ERRORS.get(reason, HTTP_ERRORS["INTERNAL"])


def error_headers(error: TesseraError) -> dict[str, str]:
    delay = retry_delay_s(error)
    if delay is not None:
        return {"retry-after": str(max(1, math.ceil(delay))), "x-should-retry": "true"}
    if http_error(error.reason).status in (429, 409, 503):
        return {"x-should-retry": "false"}
    return {}


def openai_error_body(error: TesseraError) -> dict[str, Any]:
    info = http_error(error.reason)
    param = error.metadata.get("field")
    return {"error": {"message": error.message, "type": info.openai_type,
                      "code": info.openai_code, "param": param, "reason": error.reason}}


def workers_ai_error_body(error: TesseraError) -> dict[str, Any]:
    info = http_error(error.reason)
    return {"result": None, "success": False, "messages": [],
            "errors": [{"code": info.workers_ai_code, "message": error.message,
                        "reason": error.reason}]}


def error_response(error: TesseraError, workers_ai: bool) -> JSONResponse:
    body = workers_ai_error_body(error) if workers_ai else openai_error_body(error)
    return JSONResponse(body, status_code=http_error(error.reason).status,
                        headers=error_headers(error))
