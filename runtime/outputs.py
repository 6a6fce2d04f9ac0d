"""What the engine returns per request (vLLM's RequestOutput / CompletionOutput shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import TesseraError


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    # One dict per generated token: {token_id: logprob}, chosen token always included.
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: TesseraError | None = None
    # Streaming: the text and token ids added since the previous output of this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
