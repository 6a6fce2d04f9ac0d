"""Server interceptor: a request whose bytes are not the method's message gets a typed
INVALID_ARGUMENT, instead of gRPC's UNKNOWN naming a Python exception class."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway.errors import to_status
from runtime.errors import InvalidArgument

_MALFORMED = object()


def _malformed() -> InvalidArgument:
    return InvalidArgument("the request message could not be parsed", field="request")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Parses leniently and refuses what did not parse, for unary-request methods."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception:
                return _MALFORMED

        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is _MALFORMED:
                    await context.abort_with_status(to_status(_malformed()))
                return await unary(request, context)

            return handler._replace(request_deserializer=lenient, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def unary_stream(request: Any,
                                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if request is _MALFORMED:
                    await context.abort_with_status(to_status(_malformed()))
                async for response in stream(request, context):
                    yield response

            return handler._replace(request_deserializer=lenient, unary_stream=unary_stream)
        return handler
