"""The Python SDK: `Client(target, api_key=...)` / `AsyncClient`, streaming chunks, typed errors.

    with Client("127.0.0.1:50051", api_key=KEY) as client:
        stream = client.generate("The capital of France is", max_tokens=16, temperature=0)
        for chunk in stream:
            print(chunk.text, end="")
        print(stream.usage)   # prompt_tokens, cached_tokens, completion_tokens

Errors raise one class per reason (gateway.errors.REASONS). Retryable reasons (OVERLOADED,
WORKER_LOST) are retried with backoff and a time budget, only before the first token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import gateway_pb2_grpc
from gateway.convert import ServedInfo, sampling_options
from gateway.errors import (  # noqa: F401  (re-exported: the SDK's exception classes)
    REASONS,
    PermissionDenied,
    Unauthenticated,
    from_rpc_error,
    retry_delay_s,
)
from runtime.errors import (  # noqa: F401
    ContextLengthExceeded,
    DeadlineExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    ModelNotFound,
    Overloaded,
    RequestCancelled,
    TenantQuotaExceeded,
    TesseraError,
    WorkerLost,
)

SESSION_KEY = "x-session-affinity"


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4  # the first try included
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    budget_s: float = 15.0  # total sleep across retries

    def delay(self, error: TesseraError, attempt: int, slept_s: float) -> float | None:
        """Seconds to wait before try attempt+1, or None to give up and raise."""
        hint = retry_delay_s(error)
        if hint is None or attempt + 1 >= self.max_attempts:
            return None
        delay = min(max(hint, self.initial_backoff_s * 2 ** attempt), self.max_backoff_s)
        return delay if slept_s + delay <= self.budget_s else None


NO_RETRY = RetryPolicy(max_attempts=1)


class _StreamState:
    """What a finished stream reports: usage, finish reason, the served configuration."""

    def __init__(self, retry: RetryPolicy) -> None:
        self.retry = retry
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.served: ServedInfo | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.attempts = 0
        self._cancelled = False

    def _chunk(self, resp: pb.GenerateResponse) -> Chunk:
        chunk = Chunk(resp.chunk.text, list(resp.chunk.token_ids))
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        return chunk

    def _final(self, final: pb.Final) -> None:
        u = final.usage
        self.usage = Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        self.finish_reason = final.finish_reason
        self.stop_reason = final.stop_reason or None
        self.served = ServedInfo.from_proto(final.served)

    def _error(self, e: grpc.RpcError, slept_s: float) -> tuple[TesseraError, float | None]:
        error = from_rpc_error(e)
        if self._cancelled:
            return RequestCancelled("cancelled by the client"), None
        if self.token_ids:  # tokens already out: a retry would repeat them
            return error, None
        return error, self.retry.delay(error, self.attempts - 1, slept_s)


class Stream(_StreamState):
    def __init__(self, start: Any, retry: RetryPolicy) -> None:
        super().__init__(retry)
        self._start = start
        self._call: Any = None

    def __iter__(self) -> Iterator[Chunk]:
        slept = 0.0
        while True:
            self.attempts += 1
            self._call = self._start()
            try:
                for resp in self._call:
                    if resp.HasField("chunk"):
                        yield self._chunk(resp)
                    else:
                        self._final(resp.final)
                return
            except grpc.RpcError as e:
                error, delay = self._error(e, slept)
                if delay is None:
                    raise error from None
                time.sleep(delay)
                slept += delay

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class AsyncStream(_StreamState):
    def __init__(self, start: Any, retry: RetryPolicy) -> None:
        super().__init__(retry)
        self._start = start
        self._call: Any = None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        slept = 0.0
        while True:
            self.attempts += 1
            self._call = self._start()
            try:
                async for resp in self._call:
                    if resp.HasField("chunk"):
                        yield self._chunk(resp)
                    else:
                        self._final(resp.final)
                return
            except (grpc.RpcError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and not self._cancelled:
                    raise
                error, delay = self._error(e, slept) if isinstance(e, grpc.RpcError) else (
                    RequestCancelled("cancelled by the client"), None)
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)
                slept += delay

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class _ClientBase:
    def __init__(self, api_key: str, retry: RetryPolicy, timeout_s: float | None) -> None:
        self._auth = ("authorization", f"Bearer {api_key}")
        self.retry = retry
        self.timeout_s = timeout_s

    def _metadata(self, session: str | None) -> tuple[tuple[str, str], ...]:
        return (self._auth,) if session is None else (self._auth, (SESSION_KEY, session))

    @staticmethod
    def _generate_request(prompt: str | list[int], model: str,
                          sampling: dict[str, Any]) -> pb.GenerateRequest:
        opts = sampling_options(**sampling)
        if isinstance(prompt, str):
            return pb.GenerateRequest(model=model, prompt=prompt, sampling=opts)
        return pb.GenerateRequest(model=model, prompt_token_ids=list(prompt), sampling=opts)

    @staticmethod
    def _chat_request(messages: list[dict[str, str]], model: str,
                      sampling: dict[str, Any]) -> pb.ChatRequest:
        msgs = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        return pb.ChatRequest(model=model, messages=msgs, sampling=sampling_options(**sampling))


class Client(_ClientBase):
    def __init__(self, target: str, api_key: str, *, retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = None) -> None:
        super().__init__(api_key, retry, timeout_s)
        self.channel = grpc.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str | list[int], *, model: str = "", session: str | None = None,
                 timeout_s: float | None = None, **sampling: Any) -> Stream:
        req = self._generate_request(prompt, model, sampling)
        return Stream(lambda: self.stub.Generate(req, metadata=self._metadata(session),
                                                 timeout=timeout_s or self.timeout_s),
                      self.retry)

    def chat(self, messages: list[dict[str, str]], *, model: str = "",
             session: str | None = None, timeout_s: float | None = None,
             **sampling: Any) -> Stream:
        req = self._chat_request(messages, model, sampling)
        return Stream(lambda: self.stub.Chat(req, metadata=self._metadata(session),
                                             timeout=timeout_s or self.timeout_s), self.retry)

    def list_models(self) -> list[pb.ModelInfo]:
        try:
            resp = self.stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata(None),
                                        timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return list(resp.models)

    def session(self, session_id: str | None = None) -> Session:
        """Requests made through the returned helper stay on one worker (x-session-affinity)."""
        return Session(self, session_id or uuid.uuid4().hex)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    def __init__(self, client: Client, session_id: str) -> None:
        self.client, self.id = client, session_id

    def generate(self, prompt: str | list[int], **kwargs: Any) -> Stream:
        return self.client.generate(prompt, session=self.id, **kwargs)

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Stream:
        return self.client.chat(messages, session=self.id, **kwargs)


class AsyncClient(_ClientBase):
    def __init__(self, target: str, api_key: str, *, retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = None) -> None:
        super().__init__(api_key, retry, timeout_s)
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str | list[int], *, model: str = "", session: str | None = None,
                 timeout_s: float | None = None, **sampling: Any) -> AsyncStream:
        req = self._generate_request(prompt, model, sampling)
        return AsyncStream(lambda: self.stub.Generate(req, metadata=self._metadata(session),
                                                      timeout=timeout_s or self.timeout_s),
                           self.retry)

    def chat(self, messages: list[dict[str, str]], *, model: str = "",
             session: str | None = None, timeout_s: float | None = None,
             **sampling: Any) -> AsyncStream:
        req = self._chat_request(messages, model, sampling)
        return AsyncStream(lambda: self.stub.Chat(req, metadata=self._metadata(session),
                                                  timeout=timeout_s or self.timeout_s),
                           self.retry)

    async def list_models(self) -> list[pb.ModelInfo]:
        try:
            resp = await self.stub.ListModels(pb.ListModelsRequest(),
                                              metadata=self._metadata(None),
                                              timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return list(resp.models)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
