"""The Python SDK: `Client(target, api_key=...)` / `AsyncClient`, streaming chunks, typed errors.

    with Client("127.0.0.1:50051", api_key=KEY) as client:
        stream = client.generate("The capital of France is", max_tokens=16, temperature=0)
        for chunk in stream:
            print(chunk.text, end="")
        print(stream.usage)   # prompt_tokens, cached_tokens, completion_tokens

`n=3` streams three candidates' chunks interleaved (`chunk.index`); `stream.texts[i]` and
`stream.candidates` hold each one's text and end. `logprobs=k` adds `chunk.logprobs`: each
token's logprob and the k most likely tokens'.

Errors raise one class per reason (gateway.errors.REASONS). An error the server marks
retryable (a RetryInfo: OVERLOADED, TENANT_CONCURRENCY_EXCEEDED, WORKER_LOST, UNAVAILABLE while
a server drains) is retried with backoff and a time budget, only before the first token.
Leaving a stream's loop early (`break`) leaves its request running, as the openai client's
streams do; `with client.generate(...) as stream:` cancels it on the way out, as
`stream.cancel()` does.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from typing_extensions import Unpack

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import gateway_pb2_grpc
from gateway.errors import (  # noqa: F401  (re-exported: the SDK's exception classes)
    REASONS,
    DeadlineExceeded,
    Overloaded,
    PermissionDenied,
    TenantConcurrencyExceeded,
    Unauthenticated,
    Unavailable,
    WorkerLost,
    WorkerStartFailed,
    from_rpc_error,
)
from gateway.stream import (  # noqa: F401  (re-exported)
    DEFAULT_RETRY,
    NO_RETRY,
    AsyncStream,
    Candidate,
    Chunk,
    RetryPolicy,
    Sampling,
    Stream,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gateway.wire import (  # noqa: F401
    SESSION_HEADER,
    ServedInfo,
    build_message,
    chat_message,
    sampling_options,
)
from runtime.errors import (  # noqa: F401
    ContextLengthExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    ModelNotFound,
    RequestCancelled,
    TenantQuotaExceeded,
    TesseraError,
)


class _ClientBase:
    def __init__(self, api_key: str, retry: RetryPolicy, timeout_s: float | None) -> None:
        self._auth = ("authorization", f"Bearer {api_key}")
        self.retry = retry
        self.timeout_s = timeout_s

    def _timeout(self, timeout_s: float | None) -> float | None:
        # NOTE: 0 is a deadline already passed, not "no deadline": only None falls back.
        return self.timeout_s if timeout_s is None else timeout_s

    def _metadata(self, session: str | None) -> tuple[tuple[str, str], ...]:
        return (self._auth,) if session is None else (self._auth, (SESSION_HEADER, session))

    @staticmethod
    def _generate_request(prompt: str | list[int], model: str, sampling: Sampling,
                          split_special_tokens: bool = False) -> pb.GenerateRequest:
        opts = sampling_options(**sampling)
        if isinstance(prompt, str):
            return pb.GenerateRequest(model=model, prompt=prompt, sampling=opts,
                                      split_special_tokens=split_special_tokens)
        return build_message(pb.GenerateRequest, {"model": model, "sampling": opts,
                                                   "prompt_token_ids": list(prompt)})

    @staticmethod
    def _chat_request(messages: list[dict[str, str]], model: str,
                      sampling: Sampling) -> pb.ChatRequest:
        msgs = [chat_message(m) for m in messages]
        return pb.ChatRequest(model=model, messages=msgs, sampling=sampling_options(**sampling))


class Client(_ClientBase):
    def __init__(self, target: str, api_key: str, *, retry: RetryPolicy = DEFAULT_RETRY,
                 timeout_s: float | None = None) -> None:
        super().__init__(api_key, retry, timeout_s)
        self.channel = grpc.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str | list[int], *, model: str = "", session: str | None = None,
                 timeout_s: float | None = None, split_special_tokens: bool = False,
                 **sampling: Unpack[Sampling]) -> Stream:
        """`split_special_tokens`: special-token literals in a text prompt are plain text
        (else, as in Hugging Face's tokenizers, control tokens)."""
        req = self._generate_request(prompt, model, sampling, split_special_tokens)
        return Stream(lambda: self.stub.Generate(req, metadata=self._metadata(session),
                                                 timeout=self._timeout(timeout_s)),
                      self.retry)

    def chat(self, messages: list[dict[str, str]], *, model: str = "",
             session: str | None = None, timeout_s: float | None = None,
             **sampling: Unpack[Sampling]) -> Stream:
        req = self._chat_request(messages, model, sampling)
        return Stream(lambda: self.stub.Chat(req, metadata=self._metadata(session),
                                             timeout=self._timeout(timeout_s)), self.retry)

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
    def __init__(self, target: str, api_key: str, *, retry: RetryPolicy = DEFAULT_RETRY,
                 timeout_s: float | None = None) -> None:
        super().__init__(api_key, retry, timeout_s)
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str | list[int], *, model: str = "", session: str | None = None,
                 timeout_s: float | None = None, split_special_tokens: bool = False,
                 **sampling: Unpack[Sampling]) -> AsyncStream:
        req = self._generate_request(prompt, model, sampling, split_special_tokens)
        return AsyncStream(lambda: self.stub.Generate(req, metadata=self._metadata(session),
                                                      timeout=self._timeout(timeout_s)),
                           self.retry)

    def chat(self, messages: list[dict[str, str]], *, model: str = "",
             session: str | None = None, timeout_s: float | None = None,
             **sampling: Unpack[Sampling]) -> AsyncStream:
        req = self._chat_request(messages, model, sampling)
        return AsyncStream(lambda: self.stub.Chat(req, metadata=self._metadata(session),
                                                  timeout=self._timeout(timeout_s)),
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
