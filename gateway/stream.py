"""SDK streams: chunks as they arrive, then usage, finish reason and the served configuration;
retries (backoff, a time budget) for retryable reasons only, and only before the first token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from typing_extensions import TypedDict

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway.errors import from_rpc_error, retry_delay_s
from gateway.wire import ServedInfo
from runtime.errors import RequestCancelled, TesseraError
from runtime.structured_output import StructuredOutput


class Sampling(TypedDict, total=False):
    """Sampling keyword arguments; an omitted one takes the engine's default (SamplingParams)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: str | list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    structured_output: StructuredOutput  # constrained decoding: a schema, regex or grammar


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


DEFAULT_RETRY = RetryPolicy()
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
        if resp.chunk.HasField("served"):
            self.served = ServedInfo.from_proto(resp.chunk.served)
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
