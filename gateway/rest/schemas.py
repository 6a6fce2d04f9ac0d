"""Request bodies of the HTTP APIs (pydantic), strict by design.

Strictness, documented: unknown fields are refused (400, as OpenAI does); types are not coerced
(`"0.5"` is not a number); integers must fit the wire (uint32 / int32 / uint64) and floats must
be finite. Whether a value makes sense (temperature < 0, top_p > 1, an empty conversation) is
judged by the engine, which answers INVALID_ARGUMENT naming the field: one rule, one place.
OpenAI fields that tessera does not implement are accepted only at their neutral value
(`n` = 1, no `logprobs`, no `tools`), so a client never gets a silently different answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

U32 = 2**32 - 1
I32 = 2**31 - 1
U64 = 2**64 - 1


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 (no lone surrogates)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
Float = Annotated[float, Field(allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1, le=U32)]
Stop = Text | list[Text] | None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Sampling(Strict):
    """Sampling fields shared by every generation route."""

    max_tokens: MaxTokens | None = None  # None: all the context leaves after the prompt
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[int, Field(ge=-(I32 + 1), le=I32)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    seed: Annotated[int, Field(ge=0, le=U64)] | None = None
    stop: Stop = None
    ignore_eos: bool = False

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for the SDK (None = the engine's default)."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop")
        out = {name: getattr(self, name) for name in names}
        return {**out, "ignore_eos": self.ignore_eos}


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class Message(Strict):
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    model: Text = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: Text | None = None
    logprobs: Literal[False] | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[Message]
    max_completion_tokens: MaxTokens | None = None

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self


Prompt = Text | Annotated[list[Text], Field(min_length=1, max_length=1)] | \
    Annotated[list[Annotated[int, Field(ge=0, le=U32)]], Field(min_length=1)]


class CompletionRequest(OpenAIRequest):
    prompt: Prompt
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
    """Workers AI's text-generation input: `prompt` or `messages`, never both."""

    prompt: Text | None = None
    messages: list[Message] | None = None
    stream: bool = False
    max_tokens: MaxTokens | None = 256  # Workers AI's documented default

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> WorkersAIRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self
