"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.client import AsyncStream
from gateway.rest.docs import OPENAI_ERRORS, SSE_OK
from gateway.rest.errors import openai_error_body
from gateway.rest.relay import SSE_DONE, SSE_HEADERS, Relay, sse
from gateway.rest.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from gateway.rest.tool_calls import ToolCall, ToolCallParser, forcing_grammar, render_messages
from gateway.rest.upstream import api_key, fingerprint, open_stream, served_header
from runtime.errors import TesseraError

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])


def usage_body(stream: AsyncStream) -> dict[str, Any] | None:
    u = stream.usage
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class _Shape:
    """What differs between chat and text completions: ids, object names, the choice body."""

    def __init__(self, chat: bool, model: str, tool_names: set[str] | None = None) -> None:
        self.chat, self.model = chat, model
        self.tool_names = tool_names or set()  # parse tool calls out of the text when set
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]], stream: AsyncStream,
                 usage: bool) -> dict[str, Any]:
        model = self.model or (stream.served.model if stream.served else "")
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                                "model": model, "choices": choices,
                                "system_fingerprint": fingerprint(stream.served)}
        if usage:
            body["usage"] = usage_body(stream)
        return body

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def finish_reason(self, stream: AsyncStream, called: bool) -> str | None:
        return "tool_calls" if called and stream.finish_reason == "stop" else stream.finish_reason

    def full(self, text: str, stream: AsyncStream) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": stream.finish_reason}
        if self.chat and self.tool_names:
            parser = ToolCallParser(self.tool_names)
            events = [*parser.feed(text), *parser.finish()]
            content = "".join(v for kind, v in events if kind == "content")
            choice["message"] = {"role": "assistant", "content": content or None}
            if parser.calls:
                choice["message"]["tool_calls"] = [c.as_dict() for c in parser.calls]
            choice["finish_reason"] = self.finish_reason(stream, bool(parser.calls))
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = "chat.completion" if self.chat else "text_completion"
        return self.envelope(obj, [choice], stream, usage=True)

    def delta(self, text: str | None, finish: str | None, stream: AsyncStream,
              usage: bool, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = self.envelope(self.chunk_object, [choice], stream, usage=False)
        if usage:
            body["usage"] = None
        return body

    def tool_deltas(self, index: int, call: ToolCall, stream: AsyncStream,
                    usage: bool) -> list[dict[str, Any]]:
        """A call as OpenAI streams one: its id, type and name with empty arguments, then the
        arguments (here in one piece: the call is parsed once its block is complete)."""
        heads = [{"index": index, "id": call.id, "type": "function",
                  "function": {"name": call.name, "arguments": ""}},
                 {"index": index, "function": {"arguments": call.arguments}}]
        bodies = []
        for head in heads:
            body = self.delta(None, None, stream, usage)
            body["choices"][0]["delta"]["tool_calls"] = [head]
            bodies.append(body)
        return bodies


async def _serve(request: Request, body: OpenAIRequest, shape: _Shape, route: str,
                 stream: AsyncStream) -> Response:
    relay = await Relay(stream, request, route).start()
    if not body.stream:
        text = await relay.text()
        return JSONResponse(shape.full(text, stream), headers=served_header(stream.served))
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_events(relay, shape, usage), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _events(relay: Relay, shape: _Shape, usage: bool) -> AsyncIterator[bytes]:
    stream = relay.stream
    if shape.chat:
        yield sse(shape.delta("", None, stream, usage, first=True))
    parser = ToolCallParser(shape.tool_names) if shape.tool_names else None
    try:
        async for chunk in relay.chunks():
            if parser is not None:
                for body in _tool_events(parser, parser.feed(chunk.text), shape, stream, usage):
                    yield sse(body)
            elif chunk.text:
                yield sse(shape.delta(chunk.text, None, stream, usage))
    except TesseraError as e:  # after the status line: the error travels as an event
        yield sse(openai_error_body(e))
        return
    finish = stream.finish_reason
    if parser is not None:
        for body in _tool_events(parser, parser.finish(), shape, stream, usage):
            yield sse(body)
        finish = shape.finish_reason(stream, bool(parser.calls))
    yield sse(shape.delta(None if shape.chat else "", finish, stream, usage))
    if usage:
        yield sse(shape.envelope(shape.chunk_object, [], stream, usage=True))
    yield SSE_DONE


def _tool_events(parser: ToolCallParser, events: Any, shape: _Shape, stream: AsyncStream,
                 usage: bool) -> list[dict[str, Any]]:
    bodies = []
    for kind, value in events:
        if kind == "content":
            bodies.append(shape.delta(value, None, stream, usage))
        else:
            bodies.extend(shape.tool_deltas(len(parser.calls) - 1, value, stream, usage))
    return bodies


@router.post("/chat/completions", responses={**SSE_OK, **OPENAI_ERRORS})
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    body.check_tools()
    sampling = body.sampling()
    constraint = forcing_grammar(body) or (
        body.response_format.structured_output() if body.response_format else None)
    if constraint is not None:
        sampling["structured_output"] = constraint
    messages = render_messages([m.as_dict() for m in body.messages], body)
    stream = open_stream(request, request.app.state.upstream, model=body.model,
                         messages=messages, sampling=sampling)
    tool_names = {f.name for f in body.active_tools()}
    return await _serve(request, body, _Shape(True, body.model, tool_names), "chat", stream)


@router.post("/completions", responses={**SSE_OK, **OPENAI_ERRORS})
async def completions(request: Request, body: CompletionRequest) -> Response:
    sampling = body.sampling()
    constraint = body.response_format.structured_output() if body.response_format else None
    if constraint is not None:
        sampling["structured_output"] = constraint
    stream = open_stream(request, request.app.state.upstream, model=body.model,
                         prompt=body.prompt_value(), sampling=sampling,
                         split_special_tokens=body.split_special_tokens)
    return await _serve(request, body, _Shape(False, body.model), "completions", stream)


@router.get("/models", responses=OPENAI_ERRORS)
async def list_models(request: Request) -> dict[str, Any]:
    client = request.app.state.upstream.client(api_key(request))
    models = await client.list_models()
    return {"object": "list", "data": [
        {"id": m.id, "object": "model", "created": 0, "owned_by": "tessera",
         "revision": m.revision, "max_model_len": m.max_model_len,
         "ready_workers": m.ready_workers} for m in models]}
