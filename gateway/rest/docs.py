"""What the OpenAPI document says about responses the routes build by hand: SSE streams and
the two error bodies, with every status a reason can map to."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from gateway.rest.errors import HTTP_ERRORS


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None
    reason: str


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class WorkersAIErrorItem(BaseModel):
    code: int
    message: str
    reason: str


class WorkersAIError(BaseModel):
    result: None = None
    success: bool
    errors: list[WorkersAIErrorItem]
    messages: list[Any]


_STATUSES = sorted({e.status for e in HTTP_ERRORS.values()} | {422})


def _errors(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": model, "description": "error (see `reason`)"}
            for status in _STATUSES if status != 422}


OPENAI_ERRORS = _errors(OpenAIError)
WORKERS_AI_ERRORS = _errors(WorkersAIError)
SSE_OK: dict[int | str, dict[str, Any]] = {200: {
    "description": "JSON, or with `stream: true` server-sent events ending in `data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
