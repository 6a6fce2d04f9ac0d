"""Request bodies of the HTTP APIs (pydantic), strict by design.

Strictness, documented: unknown fields are refused (400, as OpenAI does); types are not coerced
(`"0.5"` is not a number); numbers must fit the wire: integers its uint32 / int32 / uint64,
floats its float32 (finite, and a positive bound stays positive there). The sampling ranges
and the stop list's bounds are the engine's (SamplingParams checks them again, and
tests/rest/test_schemas.py holds the two to the same edges), stated here so that the OpenAPI
document says what is accepted; so are a non-empty conversation and exactly one of `prompt` /
`messages`. OpenAI fields that tessera does not implement are accepted only at their neutral
value (`n` = 1, no `logprobs`), so a client never gets a silently different answer. Tools and
`response_format` are gateway/rest/structured.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from gateway.rest.strict import Strict, Text, utf8
from gateway.rest.structured import ResponseFormat, ToolCallIn, ToolFields
from runtime.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

U32 = 2**32 - 1
I32 = 2**31 - 1
U64 = 2**64 - 1
F32_MAX = 3.4028234663852886e38
F32_MIN_POSITIVE = 2.0**-149  # the wire's float32 rounds anything smaller to 0


Float = Annotated[float, Field(allow_inf_nan=False, ge=-F32_MAX, le=F32_MAX)]
Positive = Annotated[Float, Field(ge=F32_MIN_POSITIVE)]
MaxTokens = Annotated[int, Field(ge=1, le=U32)]
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


class Message(Strict):
    role: Text
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
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    model: Text = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: Text | None = None
    logprobs: Literal[False] | None = None


Messages = Annotated[list[Message], Field(min_length=1)]


class ChatCompletionRequest(OpenAIRequest, ToolFields):
    messages: Messages
    max_completion_tokens: MaxTokens | None = None

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self


Prompt = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | \
    Annotated[list[Annotated[int, Field(ge=0, le=U32)]], Field(min_length=1)]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt
    response_format: ResponseFormat | None = None
    max_tokens: MaxTokens | None = 16  # the legacy OpenAI completions API's documented default
    # Not OpenAI's (an extra field, as vLLM accepts extras): special-token literals in a text
    # prompt are plain text, not control tokens (Hugging Face's name for it).
    split_special_tokens: bool = False

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            return str(p[0])
        return p  # type: ignore[return-value]


class WorkersAIRequest(Sampling):
    """Workers AI's text-generation input: `prompt` or `messages` (WorkersAIRun)."""

    stream: bool = False
    max_tokens: MaxTokens | None = 256  # Workers AI's documented default


class WorkersAIPrompt(WorkersAIRequest):
    prompt: NonEmptyText


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
