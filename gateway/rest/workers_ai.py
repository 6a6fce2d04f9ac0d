"""Workers-AI-style route: POST /ai/run/{model} (the model may hold slashes: `@cf/org/name`).

`prompt` is rendered through the model's chat template as one user turn unless `raw: true`
(Workers AI's semantics). Answers in Workers AI's envelope; with `"stream": true`, server-sent
events of `{"response": "<text>"}`, then one with `usage`, then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.client import AsyncStream
from gateway.rest.docs import SSE_OK, WORKERS_AI_ERRORS
from gateway.rest.errors import workers_ai_error_body
from gateway.rest.openai_api import usage_body
from gateway.rest.relay import SSE_DONE, SSE_HEADERS, Relay, sse
from gateway.rest.schemas import Text, WorkersAIPrompt, WorkersAIRun
from gateway.rest.upstream import open_stream, served_header
from runtime.errors import TesseraError

router = APIRouter(tags=["Workers-AI-style"])


def envelope(result: dict[str, Any]) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


@router.post("/ai/run/{model:path}", responses={**SSE_OK, **WORKERS_AI_ERRORS})
async def run_model(request: Request, model: Text, body: WorkersAIRun) -> Response:
    upstream = request.app.state.upstream
    if isinstance(body, WorkersAIPrompt) and body.raw:
        stream = open_stream(request, upstream, model=model, prompt=body.prompt,
                             sampling=body.sampling())
    elif isinstance(body, WorkersAIPrompt):  # Workers AI applies the chat template to `prompt`
        stream = open_stream(request, upstream, model=model, sampling=body.sampling(),
                             messages=[{"role": "user", "content": body.prompt}])
    else:
        stream = open_stream(request, upstream, model=model, sampling=body.sampling(),
                             messages=[m.as_dict() for m in body.messages])
    relay = await Relay(stream, request, "ai.run").start()
    if not body.stream:
        text = await relay.text()
        result = {"response": text, "usage": usage_body(stream),
                  "finish_reason": stream.finish_reason}
        return JSONResponse(envelope(result), headers=served_header(stream.served))
    return StreamingResponse(_events(relay, stream), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _events(relay: Relay, stream: AsyncStream) -> AsyncIterator[bytes]:
    try:
        async for chunk in relay.chunks():
            if chunk.text:
                yield sse({"response": chunk.text})
    except TesseraError as e:  # after the status line: the error travels as an event
        yield sse(workers_ai_error_body(e))
        return
    yield sse({"response": "", "usage": usage_body(stream),
               "finish_reason": stream.finish_reason})
    yield SSE_DONE
