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
    n: int  # candidates (1..16); candidate i samples with seed + i when seeded
    logprobs: int  # logprobs of each token and of this many top tokens (0..20)
    min_tokens: int  # no EOS, stop token id or stop string before this many tokens


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str  # the token's text alone
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    chosen: TopLogprob
    top: list[TopLogprob]  # most likely first

    @classmethod
    def from_proto(cls, m: pb.TokenLogprob) -> TokenLogprob:
        return cls(_top(m.chosen), [_top(t) for t in m.top])


def _top(m: pb.TopLogprob) -> TopLogprob:
    return TopLogprob(m.token_id, m.logprob, m.token, m.bytes)


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]
    index: int = 0  # the candidate
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked
    finish_reason: str | None = None  # on a candidate's last chunk
    stop_reason: str | None = None


@dataclass(frozen=True)
class Candidate:
    """How one candidate ended (Final.candidates)."""

    index: int
    finish_reason: str
    stop_reason: str | None
    completion_tokens: int
    cached_tokens: int


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
        self.text = ""  # candidate 0's
        self.token_ids: list[int] = []  # every candidate's, as they came
        self.texts: dict[int, str] = {}  # by candidate
        self.candidates: list[Candidate] = []
        self.attempts = 0
        self._cancelled = False

    def _chunk(self, resp: pb.GenerateResponse) -> Chunk:
        c = resp.chunk
        chunk = Chunk(c.text, list(c.token_ids), c.index,
                      [TokenLogprob.from_proto(m) for m in c.logprobs] if c.logprobs else None,
                      c.finish_reason or None, c.stop_reason or None)
        if c.HasField("served"):
            self.served = ServedInfo.from_proto(c.served)
        if chunk.index == 0:
            self.text += chunk.text
        self.texts[chunk.index] = self.texts.get(chunk.index, "") + chunk.text
        self.token_ids += chunk.token_ids
        return chunk

    def _final(self, final: pb.Final) -> None:
        u = final.usage
        self.usage = Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        self.finish_reason = final.finish_reason
        self.stop_reason = final.stop_reason or None
        self.served = ServedInfo.from_proto(final.served)
        self.candidates = [Candidate(c.index, c.finish_reason, c.stop_reason or None,
                                     c.completion_tokens, c.cached_tokens)
                           for c in final.candidates]

    def _error(self, e: grpc.RpcError, slept_s: float) -> tuple[TesseraError, float | None]:
        error = from_rpc_error(e)
        if self._cancelled:
            return RequestCancelled("cancelled by the client"), None
        if self.token_ids:  # tokens already out: a retry would repeat them
            return error, None
        return error, self.retry.delay(error, self.attempts - 1, slept_s)


class Stream(_StreamState):
    """One request's chunks. Single-use: iterating again continues the same request (a
    cancelled one raises RequestCancelled, a finished one yields nothing); it never sends the
    request a second time."""

    def __init__(self, start: Any, retry: RetryPolicy) -> None:
        super().__init__(retry)
        self._start = start
        self._call: Any = None
        self._chunks: Iterator[Chunk] | None = None

    def __iter__(self) -> Iterator[Chunk]:
        if self._chunks is None:
            self._chunks = self._run()
        return self._chunks

    def _run(self) -> Iterator[Chunk]:
        slept = 0.0
        while True:
            if self._cancelled:
                raise RequestCancelled("cancelled by the client")
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

    # NOTE: leaving a `for` loop early leaves the request running (the openai client's streams
    # behave so too); `with client.generate(...) as stream:` cancels it on the way out.
    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._call is not None and not self._call.done():
            self.cancel()


class AsyncStream(_StreamState):
    """The asyncio twin of `Stream`, single-use in the same way."""

    def __init__(self, start: Any, retry: RetryPolicy) -> None:
        super().__init__(retry)
        self._start = start
        self._call: Any = None
        self._chunks: AsyncIterator[Chunk] | None = None

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None and not self._call.done():
            self.cancel()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        if self._chunks is None:
            self._chunks = self._run()
        return self._chunks

    async def _run(self) -> AsyncIterator[Chunk]:
        slept = 0.0
        while True:
            if self._cancelled:
                raise RequestCancelled("cancelled by the client")
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
