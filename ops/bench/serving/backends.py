"""The two ways `tessera bench serve` sends a request: tessera's gRPC gateway through the SDK's
`AsyncClient`, or any OpenAI-compatible server's streaming `/v1/completions` (tessera's REST
shim, llama.cpp's llama-server, vLLM) through httpx. Each returns one `RequestResult`."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Protocol

from ops.bench.serving.metrics import RequestResult
from ops.bench.serving.prompts import BenchPrompt


class Backend(Protocol):
    label: str

    async def open(self) -> None: ...

    async def send(self, prompt: BenchPrompt, ignore_eos: bool) -> RequestResult: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


def client_error_reason(e: BaseException) -> str:
    """An exception class name as an UPPER_SNAKE reason (ReadTimeout -> READ_TIMEOUT)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).upper()


class _Timeline:
    """Arrival times of the chunks that carried output; TTFT and gaps from them."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.gaps.append(now - self.last)
        self.last = now

    def result(self, prompt_tokens: int, output_tokens: int, cached_tokens: int | None,
               error: str | None = None) -> RequestResult:
        end = time.perf_counter()
        ttft = None if self.first is None else self.first - self.start
        if error is None and ttft is None:
            error = "NO_OUTPUT"
        return RequestResult(prompt_tokens, output_tokens, ttft, end - self.start, self.gaps,
                             cached_tokens, error)


class GrpcBackend:
    """tessera's gateway: `usage` gives prompt, cached and completion tokens."""

    def __init__(self, label: str, target: str, api_key: str, model: str = "") -> None:
        self.label, self.target, self.api_key, self.model = label, target, api_key, model
        self.client: Any = None

    async def open(self) -> None:
        from gateway.client import NO_RETRY, AsyncClient

        # NOTE: no SDK retries: a benchmark reports OVERLOADED instead of hiding it in latency.
        self.client = AsyncClient(self.target, api_key=self.api_key, retry=NO_RETRY)

    async def send(self, prompt: BenchPrompt, ignore_eos: bool) -> RequestResult:
        from runtime.errors import TesseraError

        line = _Timeline()
        stream = self.client.generate(prompt.text, model=self.model,
                                      max_tokens=prompt.output_len, temperature=0.0,
                                      ignore_eos=ignore_eos)
        tokens = 0
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    line.chunk()
                    tokens += len(chunk.token_ids)
        except TesseraError as e:
            return line.result(prompt.prompt_tokens, tokens, None, e.reason)
        except Exception as e:
            return line.result(prompt.prompt_tokens, tokens, None, client_error_reason(e))
        u = stream.usage
        if u is None:
            return line.result(prompt.prompt_tokens, tokens, None)
        return line.result(u.prompt_tokens, u.completion_tokens, u.cached_tokens)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "backend": "grpc", "endpoint": self.target,
                "model": self.model}


def http_error_reason(status: int, body: bytes) -> str:
    """tessera's `error.reason`, else OpenAI's `error.code` / `error.type`, else HTTP_<status>."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    return _event_error_reason(error) or f"HTTP_{status}"


def _event_error_reason(error: Any) -> str | None:
    if isinstance(error, dict):
        for key in ("reason", "code", "type"):
            if isinstance(error.get(key), str) and error[key]:
                return str(error[key]).upper()
    if isinstance(error, str) and error:
        return "SERVER_ERROR"
    return None


class OpenAIBackend:
    """Streaming `/v1/completions`. Output tokens and cached tokens come from `usage` (asked
    for with `stream_options.include_usage`; cached in `prompt_tokens_details.cached_tokens`),
    else from llama-server's `timings` (`predicted_n`, `cache_n`), else the count of chunks."""

    def __init__(self, label: str, base_url: str, api_key: str | None = None,
                 model: str | None = None, max_connections: int = 512) -> None:
        self.label, self.base_url = label, base_url.rstrip("/")
        self.api_key, self.model, self.max_connections = api_key, model, max_connections
        self.http: Any = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def open(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.max_connections,
                              max_keepalive_connections=self.max_connections)
        self.http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30))
        if self.model is None:  # the server's first model, as `vllm bench serve` does
            resp = await self.http.get(f"{self.base_url}/models", headers=self.headers)
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]

    async def send(self, prompt: BenchPrompt, ignore_eos: bool) -> RequestResult:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt.text,
                                "max_tokens": prompt.output_len, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:  # not OpenAI's; vLLM, llama-server and tessera's shim accept it
            body["ignore_eos"] = True
        line = _Timeline()
        chunks, usage, timings, error = 0, None, None, None
        try:
            async with self.http.stream("POST", f"{self.base_url}/completions", json=body,
                                        headers=self.headers) as resp:
                if resp.status_code != 200:
                    reason = http_error_reason(resp.status_code, await resp.aread())
                    return line.result(prompt.prompt_tokens, 0, None, reason)
                async for raw in resp.aiter_lines():
                    if not raw.startswith("data:"):
                        continue
                    data = raw[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = _event_error_reason(event["error"]) or "SERVER_ERROR"
                        break
                    choices = event.get("choices") or []
                    if choices and choices[0].get("text"):
                        line.chunk()
                        chunks += 1
                    usage = event.get("usage") or usage
                    timings = event.get("timings") or timings
        except Exception as e:
            return line.result(prompt.prompt_tokens, chunks, None, client_error_reason(e))
        prompt_tokens, output_tokens, cached = _counts(prompt, chunks, usage, timings)
        return line.result(prompt_tokens, output_tokens, cached, error)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "backend": "openai", "endpoint": self.base_url,
                "model": self.model}


def _counts(prompt: BenchPrompt, chunks: int, usage: dict | None,
            timings: dict | None) -> tuple[int, int, int | None]:
    """(prompt tokens, output tokens, cached tokens or None) from what the server reported."""
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if cached is None and timings and "cache_n" in timings:
            cached = timings["cache_n"]
        return (int(usage.get("prompt_tokens", prompt.prompt_tokens)),
                int(usage.get("completion_tokens", chunks)),
                None if cached is None else int(cached))
    if timings and "predicted_n" in timings:
        cached = timings.get("cache_n")
        prompt_n = int(timings.get("prompt_n", 0)) + int(cached or 0)
        return (prompt_n or prompt.prompt_tokens, int(timings["predicted_n"]),
                None if cached is None else int(cached))
    return prompt.prompt_tokens, chunks, None
