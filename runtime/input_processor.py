"""The engine's input processor (vLLM v1's `Processor`): a prompt becomes the token ids the
engine admits, once per request and off the engine thread.

Chat messages are rendered with the model's template and tokenized so that control tokens come
only from the template; text is tokenized with the tokenizer's rules (special-token literals are
control tokens unless `split_special_tokens`); given token ids are checked against the
vocabulary. The result, a `ProcessedPrompt`, is what `LLMEngine.add_request` takes without
checking it again: the asyncio front and the worker run `process` in a pool thread, so neither a
megabyte prompt nor a long id list costs the engine thread a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidArgument
from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt as the engine admits it. Build it with `InputProcessor` (or from ids one built
    before), never from unchecked ids: the engine trusts `token_ids` (each in [0, vocab))."""

    token_ids: list[int]
    text: str | None = None  # the text the ids came from, when the prompt was text
    from_messages: bool = False  # rendered from chat messages (errors name "the messages")


Prompt = str | list[int] | ProcessedPrompt


class InputProcessor:
    """Prompts to `ProcessedPrompt`s for one tokenizer and vocabulary. Thread-safe: it holds no
    state beyond the tokenizer, whose encoders may run from any thread at once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits' width), which bounds ids

    def process(self, prompt: Prompt, *, split_special_tokens: bool = False) -> ProcessedPrompt:
        """`prompt` as the engine admits it: text tokenized, ids checked, a ProcessedPrompt as
        it is. InvalidArgument (field "prompt") for empty text, an id outside the vocabulary,
        or anything else."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is empty", field="prompt")
            ids = self.tokenizer.encode(prompt, split_special_tokens=split_special_tokens)
            return ProcessedPrompt(ids, prompt)
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(self.check_ids(prompt))
        raise InvalidArgument(f"prompt must be a string or a list of token ids, "
                              f"got {type(prompt).__name__}", field="prompt")

    def process_chat(self, messages: list[dict[str, Any]],
                     add_generation_prompt: bool = True) -> ProcessedPrompt:
        """A conversation rendered with the chat template; message contents are plain text (a
        "<|im_end|>" in one is text, never a control token). Errors as `Tokenizer.encode_chat`."""
        return ProcessedPrompt(self.tokenizer.encode_chat(messages, add_generation_prompt),
                               from_messages=True)

    def check_ids(self, ids: list[int] | tuple[int, ...]) -> list[int]:
        """`ids` as a list when every one is an int in [0, vocab_size), else InvalidArgument."""
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
               for t in ids):
            raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab})",
                                  field="prompt")
        return list(ids)
