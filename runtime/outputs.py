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


@dataclass
class EngineCoreOutput:
    """What one step (or an abort) adds to one request, as it leaves the engine (vLLM v1's
    EngineCoreOutput): the new token ids, text and logprobs only, never the whole lists, so a
    step's outputs cost the same at the thousandth token as at the first. `OutputAccumulator`
    turns a request's deltas back into RequestOutputs, on the consumer's side."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None  # one per new token, when asked for
    finished: bool  # the engine is done with it (a handed-over prefill too)
    finish_reason: str | None = None  # None while running, and for a handed-over prefill
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: TesseraError | None = None

    def merge(self, later: EngineCoreOutput) -> EngineCoreOutput:
        """This delta followed by `later` (a consumer that lagged gets them as one)."""
        lps = (None if self.new_logprobs is None and later.new_logprobs is None
               else (self.new_logprobs or []) + (later.new_logprobs or []))
        return EngineCoreOutput(self.request_id, self.new_token_ids + later.new_token_ids,
                                self.new_text + later.new_text, lps, later.finished,
                                later.finish_reason, later.stop_reason, later.num_cached_tokens,
                                later.error)


class OutputAccumulator:
    """One request's outputs rebuilt from its deltas, where they are consumed: the token ids,
    text and logprobs so far. The lists of the RequestOutputs it returns are its own and grow
    with the next delta (vLLM's cumulative outputs do the same); copy them to keep a snapshot."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 token_ids: list[int] | None = None, text: str = "",
                 logprobs: list[dict[int, float]] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(token_ids or [])
        self.text = text
        self.logprobs = None if logprobs is None else list(logprobs)

    def add(self, delta: EngineCoreOutput) -> RequestOutput:
        """Apply one delta (or several merged); the request's output as of it."""
        self.token_ids += delta.new_token_ids
        self.text += delta.new_text
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.new_logprobs
        completion = CompletionOutput(0, self.text, self.token_ids, delta.finish_reason,
                                      delta.stop_reason, self.logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             delta.finished, delta.num_cached_tokens, delta.error,
                             delta.new_text, list(delta.new_token_ids))
