"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.client import AsyncStream
from gateway.errors import TenantConcurrencyExceeded
from gateway.rest.choices import Choices, ToolParsing
from gateway.rest.docs import OPENAI_ERRORS, SSE_OK
from gateway.rest.errors import openai_error_body
from gateway.rest.relay import SSE_DONE, SSE_HEADERS, Relay, merged, sse
from gateway.rest.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from gateway.rest.structured import NamedToolChoice
from gateway.rest.tool_calls import forcing_grammar, render_messages
from gateway.rest.upstream import api_key, fingerprint, open_stream, served_header
from runtime.errors import InvalidArgument, TesseraError

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])


def usage_body(*streams: AsyncStream) -> dict[str, Any] | None:
    """Usage over one or more streams (a list of prompts): each prompt counted once, every
    candidate's tokens counted."""
    usages = [s.usage for s in streams]
    if any(u is None for u in usages):
        return None
    prompt = sum(u.prompt_tokens for u in usages)  # type: ignore[union-attr]
    completion = sum(u.completion_tokens for u in usages)  # type: ignore[union-attr]
    cached = sum(u.cached_tokens for u in usages)  # type: ignore[union-attr]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Shape:
    """What differs between chat and text completions: ids, object names, the envelope."""

    def __init__(self, chat: bool, body: OpenAIRequest,
                 tools: ToolParsing | None = None) -> None:
        self.chat, self.model, self.n = chat, body.model, body.n
        self.tools = tools  # parse tool calls out of the text when set
        self.logprobs = body.logprob_count() is not None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._frame: tuple[object, bool, bytes, bytes] | None = None  # served, usage, bytes

    def envelope(self, obj: str, choices: list[dict[str, Any]], streams: list[AsyncStream],
                 usage: bool) -> dict[str, Any]:
        served = next((s.served for s in streams if s.served), None)
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                                "model": self.model or (served.model if served else ""),
                                "choices": choices, "system_fingerprint": fingerprint(served)}
        if usage:
            body["usage"] = usage_body(*streams)
        return body

    def chunk_event(self, choice: dict[str, Any], streams: list[AsyncStream],
                    usage: bool) -> bytes:
        """One stream chunk's SSE event: the bytes `sse(envelope(chunk_object, [choice], ...))`
        gives (with `"usage": null` when usage was asked for), its envelope serialized once
        per stream (per served configuration) rather than at every token."""
        served = next((s.served for s in streams if s.served), None)
        if self._frame is None or self._frame[0] is not served or self._frame[1] != usage:
            body = self.envelope(self.chunk_object, [], streams, usage=False)
            if usage:
                body["usage"] = None
            text = json.dumps(body, separators=(",", ":"))
            cut = text.index('"choices":[]') + len('"choices":[')
            self._frame = (served, usage, f"data: {text[:cut]}".encode(),
                           f"{text[cut:]}\n\n".encode())
        _, _, head, tail = self._frame
        return head + json.dumps(choice, separators=(",", ":")).encode() + tail

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


async def _serve(request: Request, body: OpenAIRequest, shape: _Shape, route: str,
                 streams: list[AsyncStream]) -> Response:
    relays = [Relay(stream, request, route) for stream in streams]
    # NOTE: every prompt starts at once; each start waits for its first token (or its error).
    started = await asyncio.gather(*(r.start() for r in relays), return_exceptions=True)
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        for relay in relays:
            relay.close()
        _refuse_a_list_that_never_fits(len(relays), failed)
        raise failed[0]
    choices = [Choices(shape.chat, shape.logprobs, k * shape.n, shape.tools)
               for k in range(len(relays))]
    if not body.stream:
        async for k, chunk in merged(relays):
            choices[k].add(chunk)
        bodies = [b for chosen in choices for b in chosen.bodies(shape.n)]
        return JSONResponse(shape.envelope(shape.object, bodies, streams, usage=True),
                            headers=served_header(streams[0].served))
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_events(relays, choices, shape, usage),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _refuse_a_list_that_never_fits(prompts: int, failed: list[BaseException]) -> None:
    """A prompt list runs as one gateway request per prompt, all at once, each counted against
    the key's limits. A list longer than `max_inflight + max_queued` is refused by those limits
    however idle the server is: INVALID_ARGUMENT (param `prompt`, problem
    `exceeds_tenant_limits`, not retryable) instead of the retryable 429 a busy key gets."""
    refusal = next((e for e in failed if isinstance(e, TenantConcurrencyExceeded)), None)
    if refusal is None or prompts < 2:
        return
    inflight, queued = refusal.metadata.get("max_inflight"), refusal.metadata.get("max_queued")
    if inflight is None or queued is None or prompts <= int(inflight) + int(queued):
        return
    raise InvalidArgument(
        f"a list of {prompts} prompts can never run within this key's limits (max_inflight="
        f"{inflight}, max_queued={queued}): send at most {int(inflight) + int(queued)} prompts "
        "per request", field="prompt", problem="exceeds_tenant_limits",
        max_inflight=inflight, max_queued=queued)


async def _events(relays: list[Relay], choices: list[Choices], shape: _Shape,
                  usage: bool) -> AsyncIterator[bytes]:
    streams = [r.stream for r in relays]

    def event(choice: dict[str, Any]) -> bytes:
        return shape.chunk_event(choice, streams, usage)

    if shape.chat:
        for i in range(len(relays) * shape.n):
            yield event({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
    try:
        async for k, chunk in merged(relays):
            for choice in choices[k].add(chunk):
                yield event(choice)
    except TesseraError as e:  # after the status line: the error travels as an event
        yield sse(openai_error_body(e))
        return
    if usage:
        yield sse(shape.envelope(shape.chunk_object, [], streams, usage=True))
    yield SSE_DONE


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
    tools = ToolParsing(frozenset(f.name for f in body.active_tools()),
                        1 if body.parallel_tool_calls is False else None,
                        isinstance(body.tool_choice, NamedToolChoice))
    return await _serve(request, body, _Shape(True, body, tools), "chat", [stream])


@router.post("/completions", responses={**SSE_OK, **OPENAI_ERRORS})
async def completions(request: Request, body: CompletionRequest) -> Response:
    sampling = body.sampling()
    constraint = body.response_format.structured_output() if body.response_format else None
    if constraint is not None:
        sampling["structured_output"] = constraint
    streams = [open_stream(request, request.app.state.upstream, model=body.model, prompt=p,
                           sampling=sampling,
                           split_special_tokens=body.split_special_tokens)
               for p in body.prompt_values()]
    return await _serve(request, body, _Shape(False, body), "completions", streams)


@router.get("/models", responses=OPENAI_ERRORS)
async def list_models(request: Request) -> dict[str, Any]:
    client = request.app.state.upstream.client(api_key(request))
    models = await client.list_models()
    return {"object": "list", "data": [
        {"id": m.id, "object": "model", "created": 0, "owned_by": "tessera",
         "revision": m.revision, "max_model_len": m.max_model_len,
         "ready_workers": m.ready_workers, "state": m.state,
         **({"start_error": m.start_error} if m.start_error else {})} for m in models]}
