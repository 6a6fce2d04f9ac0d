"""Benchmark prompts: random token ids of a real tokenizer decoded to text, so any server (gRPC or
HTTP, tessera or another engine) gets text of about the requested number of tokens; optionally
a few shared prefixes repeated across prompts, to exercise prefix caching."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


class TextTokenizer(Protocol):
    vocab_size: int
    special_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    prompt_tokens: int  # the client's own count (the server's usage wins where reported)
    output_len: int


class PromptMaker:
    """Seeded random-text prompts from one tokenizer's ordinary (non-special) tokens."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        # NOTE: tokens whose lone decoding is a partial UTF-8 sequence or empty re-encode to
        # other tokens; leaving them out makes the text's token count converge quickly.
        self.token_ids = [i for i in range(tokenizer.vocab_size)
                          if i not in tokenizer.special_ids
                          and (s := tokenizer.decode([i])) and "\ufffd" not in s]

    def random_text(self, rng: random.Random, num_tokens: int) -> str:
        """Text that re-encodes to `num_tokens` tokens (a few more or fewer at worst)."""
        ids = rng.choices(self.token_ids, k=num_tokens)
        text = self.tokenizer.decode(ids)
        for _ in range(8):
            got = self.tokenizer.encode(text, add_special_tokens=False)
            if len(got) == num_tokens:
                break
            ids = got[:num_tokens] + rng.choices(self.token_ids, k=max(0, num_tokens - len(got)))
            text = self.tokenizer.decode(ids)
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def random_prompts(self, num_prompts: int, input_len: int, output_len: int,
                       seed: int) -> list[BenchPrompt]:
        rng = random.Random(seed)
        texts = [self.random_text(rng, input_len) for _ in range(num_prompts)]
        return [BenchPrompt(t, self.count(t), output_len) for t in texts]

    def prefix_prompts(self, num_prompts: int, prefix_len: int, num_prefixes: int,
                       suffix_len: int, output_len: int, seed: int) -> list[BenchPrompt]:
        """`num_prefixes` shared prefixes of `prefix_len` tokens, each prompt one of them (in
        turn, then shuffled) plus its own random suffix of `suffix_len` tokens."""
        rng = random.Random(seed)
        prefixes = [self.random_text(rng, prefix_len) for _ in range(num_prefixes)]
        texts = [prefixes[i % num_prefixes] + self.random_text(rng, suffix_len)
                 for i in range(num_prompts)]
        rng.shuffle(texts)
        return [BenchPrompt(t, self.count(t), output_len) for t in texts]
