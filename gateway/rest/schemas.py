"""Request bodies of the HTTP APIs (pydantic), strict by design.

Strictness, documented: unknown fields are refused (400, as OpenAI does); types are not coerced
(`"0.5"` is not a number); numbers must fit the wire: integers its uint32 / int32 / uint64,
floats its float32 (finite, and a positive bound stays positive there). The sampling ranges
and the stop list's bounds are the engine's (SamplingParams checks them again, and
tests/rest/test_schemas.py holds the two to the same edges), stated here so that the OpenAPI
document says what is accepted; so are a non-empty conversation and exactly one of `prompt` /
`messages`. OpenAI fields that tessera does not implement are refused unless at their neutral
value, so a client never gets a silently different answer. `n` (up to MAX_CANDIDATES, where
OpenAI allows 128: each candidate holds its own KV pages past the prompt), `logprobs` /
`top_logprobs` (chat: `top_logprobs` needs `logprobs: true`, as OpenAI rules) and vLLM's
`min_tokens` are served; `/v1/completions` takes up to MAX_PROMPTS prompts. Tools and
`response_format` are gateway/rest/structured.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from gateway.rest.strict import Strict, Text, utf8
from gateway.rest.structured import ResponseFormat, ToolCallIn, ToolFields
from runtime.chat_roles import CHAT_ROLES
from runtime.sampling_params import (
    MAX_CANDIDATES,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)

U32 = 2**32 - 1
I32 = 2**31 - 1
U64 = 2**64 - 1
F32_MAX = 3.4028234663852886e38
F32_MIN_POSITIVE = 2.0**-149  # the wire's float32 rounds anything smaller to 0


Float = Annotated[float, Field(allow_inf_nan=False, ge=-F32_MAX, le=F32_MAX)]
Positive = Annotated[Float, Field(ge=F32_MIN_POSITIVE)]
# NOTE: no upper bound here: any max_tokens past the context is CONTEXT_LENGTH_EXCEEDED, however
# large (the SDK refuses those the wire cannot carry with that class, before any call).
MaxTokens = Annotated[int, Field(ge=1)]
Penalty = Annotated[Float, Field(ge=-2, le=2)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(utf8)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(utf8)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class Sampling(Strict):
    """Sampling fields shared by every generation route."""

    max_tokens: MaxTokens | None = None  # None: all the context leaves after the prompt
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Positive, Field(le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=I32)] | None = None  # -1 and 0: off
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Positive | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Field(ge=0, le=U64)] | None = None
    stop: Stop = None
    ignore_eos: bool = False

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for the SDK (None = the engine's default)."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop")
        out = {name: getattr(self, name) for name in names}
        if out["top_k"] == 0:  # NOTE: -1 means off to every worker version; 0 only to newer ones
            out["top_k"] = -1
        return {**out, "ignore_eos": self.ignore_eos}


class TextPart(Strict):
    type: Literal["text"]
    text: Text


# The roles runtime.chat_roles.CHAT_ROLES names, spelled out so the OpenAPI document lists them.
Role = Literal["system", "developer", "user", "assistant", "tool"]
assert get_args(Role) == CHAT_ROLES


class Message(Strict):
    role: Role
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls, sent back
    tool_call_id: Text | None = None  # a `role: "tool"` result answers this call

    @model_validator(mode="after")
    def _tool_roles(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role `tool` needs `tool_call_id`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only a message with role `assistant` carries `tool_calls`")
        return self

    def as_dict(self) -> dict[str, Any]:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_call_id:
            msg["tool_call_id"] = self.tool_call_id
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return msg


class StreamOptions(Strict):
    include_usage: bool = False


TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class OpenAIRequest(Sampling):
    model: Text = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CANDIDATES)] = 1
    user: Text | None = None
    # vLLM's: EOS, stop token ids and stop strings end no candidate before this many tokens.
    min_tokens: Annotated[int, Field(ge=0, le=U32)] | None = None

    def logprob_count(self) -> int | None:
        """How many top tokens to return per position; None: no logprobs at all."""
        return None

    def sampling(self) -> dict[str, Any]:
        return {**super().sampling(), "n": self.n, "min_tokens": self.min_tokens,
                "logprobs": self.logprob_count()}


Messages = Annotated[list[Message], Field(min_length=1)]


class ChatCompletionRequest(OpenAIRequest, ToolFields):
    messages: Messages
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self


MAX_PROMPTS = 16  # prompts in one /v1/completions request (each a request to the gateway)
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=U32)]], Field(min_length=1)]
Prompt = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1,
                                                            max_length=MAX_PROMPTS)] | \
    TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt
    response_format: ResponseFormat | None = None
    max_tokens: MaxTokens | None = 16  # the legacy OpenAI completions API's documented default
    # Not OpenAI's (an extra field, as vLLM accepts extras): special-token literals in a text
    # prompt are plain text, not control tokens (Hugging Face's name for it).
    split_special_tokens: bool = False
    logprobs: TopLogprobs | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_values(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids (choices are indexed across them)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class WorkersAIRequest(Sampling):
    """Workers AI's text-generation input: `prompt` or `messages` (WorkersAIRun)."""

    stream: bool = False
    max_tokens: MaxTokens | None = 256  # Workers AI's documented default


class WorkersAIPrompt(WorkersAIRequest):
    prompt: NonEmptyText
    # Workers AI's: false (the default) renders `prompt` as one user turn through the model's
    # chat template; true sends it as is, in the model's own prompt format.
    raw: bool = False


class WorkersAIMessages(WorkersAIRequest):
    messages: Messages


# NOTE: pydantic names the chosen member in each error's location, right after `body`.
RUN_TAGS = ("prompt input", "messages input")


def _run_kind(body: Any) -> str | None:
    if isinstance(body, WorkersAIRequest):
        return RUN_TAGS[0] if isinstance(body, WorkersAIPrompt) else RUN_TAGS[1]
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        return None
    return RUN_TAGS[0] if "prompt" in body else RUN_TAGS[1]


# A `oneOf` in the document: exactly one of `prompt` or `messages`, each member strict.
WorkersAIRun = Annotated[
    Annotated[WorkersAIPrompt, Tag(RUN_TAGS[0])] | Annotated[WorkersAIMessages, Tag(RUN_TAGS[1])],
    Discriminator(_run_kind, custom_error_type="prompt_or_messages",
                  custom_error_message="the body must be an object with exactly one of `prompt` "
                                       "or `messages`")]
