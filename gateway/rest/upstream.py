"""The shim's only way to the gateway: the SDK's AsyncClient, one shared channel, the caller's
own API key and session on every call (so auth, affinity and usage are the gateway's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from starlette.requests import Request

from gateway.client import NO_RETRY, AsyncClient, AsyncStream, RetryPolicy
from gateway.client import _ClientBase as ClientBase
from gateway.errors import Unauthenticated
from gateway.rest.errors import ShimError
from gateway.wire import MAX_NAME_BYTES, SESSION_HEADER, ServedInfo

SERVED_HEADER = "x-tessera-served"
# NOTE: both travel to the gateway as gRPC metadata, so both are bounded here, at the edge.
MAX_API_KEY_BYTES = 256
_PRINTABLE = {chr(c) for c in range(0x20, 0x7F)}


class _CallerClient(AsyncClient):
    """An AsyncClient on the shared channel, presenting the HTTP caller's key."""

    def __init__(self, shared: AsyncClient, api_key: str) -> None:
        ClientBase.__init__(self, api_key, shared.retry, shared.timeout_s)
        self.channel, self.stub = shared.channel, shared.stub


class Upstream:
    # NOTE: no retries here: an HTTP client sees OVERLOADED as 429 + Retry-After and decides
    # itself (the openai package retries 429 on its own); the gateway already retries a lost
    # worker before the first token.
    def __init__(self, target: str, retry: RetryPolicy = NO_RETRY,
                 timeout_s: float | None = None) -> None:
        self.target, self.retry, self.timeout_s = target, retry, timeout_s
        self._shared: AsyncClient | None = None

    def client(self, api_key: str) -> AsyncClient:
        if self._shared is None:  # created on first use, inside the serving event loop
            self._shared = AsyncClient(self.target, api_key="", retry=self.retry,
                                       timeout_s=self.timeout_s)
        return _CallerClient(self._shared, api_key)

    async def serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the gateway's gRPC health service reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channel = self.client("").channel
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()


def bearer_token(headers: Mapping[str, str]) -> str:
    """The API key; missing or malformed (not printable ASCII, over 256 bytes) is
    UNAUTHENTICATED, whatever its size."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("missing `Authorization: Bearer <api key>` header")
    if len(token) > MAX_API_KEY_BYTES or not set(token) <= _PRINTABLE:
        raise Unauthenticated(f"malformed API key (printable ASCII, at most "
                              f"{MAX_API_KEY_BYTES} bytes)")
    return token


def session_id(headers: Mapping[str, str]) -> str | None:
    value = headers.get(SESSION_HEADER)
    if not value:
        return None
    if len(value) > MAX_NAME_BYTES or not set(value) <= _PRINTABLE:
        raise ShimError("INVALID_ARGUMENT", f"{SESSION_HEADER} must be printable ASCII of at "
                        f"most {MAX_NAME_BYTES} bytes", field=SESSION_HEADER)
    return value


def api_key(request: Request) -> str:
    return bearer_token(request.headers)


def session(request: Request) -> str | None:
    return session_id(request.headers)


def open_stream(request: Request, upstream: Upstream, *, model: str,
                prompt: str | list[int] | None = None,
                messages: list[dict[str, str]] | None = None,
                sampling: dict[str, Any], split_special_tokens: bool = False) -> AsyncStream:
    client = upstream.client(api_key(request))
    if messages is not None:
        return client.chat(messages, model=model, session=session(request), **sampling)
    assert prompt is not None
    return client.generate(prompt, model=model, session=session(request),
                           split_special_tokens=split_special_tokens, **sampling)


def served_header(served: ServedInfo | None) -> dict[str, str]:
    """`model=...; revision=...; prefill=weights/kv; decode=weights/kv; worker=...`."""
    if served is None:
        return {}
    value = (f"model={served.model}; revision={served.revision}; "
             f"prefill={served.prefill_weights}/{served.prefill_kv_cache}; "
             f"decode={served.decode_weights}/{served.decode_kv_cache}; "
             f"worker={served.worker_id}")
    return {SERVED_HEADER: value}


def fingerprint(served: ServedInfo | None) -> str | None:
    """OpenAI's `system_fingerprint` (the backend configuration) as one compact string."""
    if served is None:
        return None
    return (f"{served.model}@{served.revision}:{served.prefill_weights}-"
            f"{served.prefill_kv_cache}/{served.decode_weights}-{served.decode_kv_cache}")
