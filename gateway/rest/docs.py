"""What the OpenAPI document says about responses the routes build by hand (SSE streams and
the two error bodies, with every status a reason can map to), and `/docs` (Swagger UI) and
`/redoc`, served from the files the `fastapi-offline` package ships (Swagger UI 5, which reads
FastAPI's OpenAPI 3.1): they work with no internet, where FastAPI's own pages load from a
CDN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from pydantic import BaseModel
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

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


DOCS_ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """`/docs`, `/redoc` and their assets (build the app with `docs_url=None, redoc_url=None`
    so FastAPI's CDN pages are not also served)."""
    import fastapi_offline

    static = Path(fastapi_offline.__file__).parent / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=static), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - docs",
                              redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
                              with_google_fonts=False)
