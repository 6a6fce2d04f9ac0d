"""The REST shim: OpenAI-compatible and Workers-AI-style HTTP APIs, a client of the gateway
through the SDK, with a status page at `/` (see gateway.rest.app)."""

from __future__ import annotations

from gateway.rest.app import build_app
from gateway.rest.http_server import RestServer
from gateway.rest.status import GatewayView, ShimStats
from gateway.rest.upstream import Upstream

__all__ = ["GatewayView", "RestServer", "ShimStats", "Upstream", "build_app"]
