"""Locust users that talk to tessera: over gRPC with the SDK (`gateway.client.Client`) and over
HTTP (OpenAI `/v1/chat/completions` and Workers-AI `/ai/run`, both streamed). Each
call is one CallRecord; nothing is retried, so every refusal shows as a failure by reason."""

from __future__ import annotations

import json
from typing import Any

from geventhttpclient import HTTPClient
from locust import User, between, task

from gateway.client import NO_RETRY, Client
from gateway.wire import SESSION_HEADER
from loadtest.options import ITERATIONS
from loadtest.record import CallRecord
from runtime.errors import TesseraError

Messages = list[dict[str, str]]


class TesseraUser(User):
    """One iteration = once(); with --max-iterations a bounded user stops after that many."""

    abstract = True
    background = False  # True: load that runs until the bounded users are done (the abuser)
    key_option = "api_key"
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.options = self.environment.parsed_options
        self.api_key = getattr(self.options, self.key_option)
        if not self.api_key:
            raise ValueError(f"{type(self).__name__} needs --{self.key_option.replace('_', '-')}")
        self.iterations = 0
        if not self.background:
            ITERATIONS.started()

    @task
    def iteration(self) -> None:
        self.once()
        self.iterations += 1
        if not self.background:
            ITERATIONS.done(self.iterations, self.options.max_iterations)

    def once(self) -> None:
        raise NotImplementedError

    def chat(self, messages: Messages, *, scenario: str, session: str | None = None) -> str | None:
        """One streamed chat completion: the reply's text, or None when it failed."""
        raise NotImplementedError


class GrpcUser(TesseraUser):
    abstract = True

    def on_start(self) -> None:
        super().on_start()
        self.client = Client(self.options.grpc_target, api_key=self.api_key, retry=NO_RETRY)

    def on_stop(self) -> None:
        self.client.close()

    def chat(self, messages: Messages, *, scenario: str, session: str | None = None) -> str | None:
        record = CallRecord(self.environment.events, "gRPC", f"Chat [{scenario}]")
        stream = self.client.chat(messages, model=self.options.model, session=session,
                                  max_tokens=self.options.max_tokens, ignore_eos=True)
        try:
            for chunk in stream:
                record.chunk(chunk.text)
        except TesseraError as e:
            record.failed(e.reason)
            return None
        usage = stream.usage
        if usage is None:
            record.failed("NO_USAGE")
            return None
        record.succeeded(usage.completion_tokens, usage.cached_tokens)
        return record.text


class RestUser(TesseraUser):
    abstract = True
    host = "http://127.0.0.1:8000"

    def on_start(self) -> None:
        super().on_start()
        # NOTE: geventhttpclient (locust's own HTTP engine) rather than httpx: under gevent's
        # patching httpcore imports trio where it is installed, and trio fails there.
        self.http = HTTPClient.from_url(self.host or RestUser.host, concurrency=1,
                                        connection_timeout=10, network_timeout=300)
        self.headers = {"authorization": f"Bearer {self.api_key}",
                        "content-type": "application/json"}
        self.model = self.options.model or self._first_model()

    def on_stop(self) -> None:
        self.http.close()

    def _first_model(self) -> str:
        response = self.http.get("/v1/models", headers=self.headers)
        body = json.loads(response.read())
        if response.status_code != 200:
            raise RuntimeError(f"GET /v1/models: {response.status_code} {error_reason(body)}")
        return body["data"][0]["id"]

    def chat(self, messages: Messages, *, scenario: str, session: str | None = None) -> str | None:
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        return self._stream("/v1/chat/completions", "/v1/chat/completions", body, scenario,
                            session)

    def ai_run(self, messages: Messages, *, scenario: str,
               session: str | None = None) -> str | None:
        """The same over the Workers-AI-style route."""
        return self._stream(f"/ai/run/{self.model}", "/ai/run", {"messages": messages,
                            "stream": True}, scenario, session)

    def _stream(self, path: str, route: str, body: dict[str, Any], scenario: str,
                session: str | None) -> str | None:
        record = CallRecord(self.environment.events, "POST", f"{route} [{scenario}]")
        body = {**body, "max_tokens": self.options.max_tokens, "ignore_eos": True}
        headers = {**self.headers, SESSION_HEADER: session} if session else self.headers
        usage: dict[str, Any] | None = None
        failure: str | None = None
        try:
            response = self.http.post(path, body=json.dumps(body), headers=headers)
            if response.status_code != 200:
                failure = error_reason(json.loads(response.read())) or \
                    f"HTTP_{response.status_code}"
            # NOTE: read to the end whatever happens, so the connection can be used again.
            for line in iter(lambda: response.readline(b"\n"), b""):
                if failure is not None or not line.startswith(b"data: "):
                    continue
                data = line.removeprefix(b"data: ").strip()
                if data == b"[DONE]":
                    continue
                event = json.loads(data)
                failure = error_reason(event)
                if text := reply_text(event):
                    record.chunk(text)
                usage = event.get("usage") or usage
        except (OSError, ValueError) as e:
            failure = type(e).__name__
        if failure is None and usage is None:
            failure = "NO_USAGE"
        if failure is not None:
            record.failed(failure)
            return None
        assert usage is not None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record.succeeded(usage["completion_tokens"], cached)
        return record.text


def error_reason(body: dict[str, Any]) -> str | None:
    """The typed reason in an OpenAI error body or a Workers-AI envelope (or SSE event)."""
    if isinstance(body.get("error"), dict):
        return body["error"].get("reason")
    errors = body.get("errors")
    if body.get("success") is False and errors:
        return errors[0].get("reason")
    return None


def reply_text(event: dict[str, Any]) -> str:
    """The text an SSE event adds: an OpenAI chunk's delta, or Workers AI's `response`."""
    choices = event.get("choices")
    if choices:
        return (choices[0].get("delta") or {}).get("content") or ""
    return event.get("response") or ""
