"""Incremental detokenization and stop strings.

Text is released only when it is complete: never half a UTF-8 character (the byte-level BPE
decoder yields U+FFFD for a partial one) and never the first characters of what may become a
stop string. A stop string is cut from the output (unless asked to keep it).
"""

from __future__ import annotations

from runtime.tokenizer import Tokenizer

# Tokens of context decoded before the new ones, so that merges across the boundary are right.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        """`min_tokens`: stop strings are looked for only once more tokens than this were added
        (vLLM's rule), so the first min_tokens tokens never end the text."""
        self.tokenizer = tokenizer
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded output text so far (stop string already cut)
        self.emitted = 0  # characters of `text` already released
        self.stopped_on: str | None = None
        self.min_tokens = min_tokens
        self.num_added = 0

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets `stopped_on` when a stop string completes."""
        self.tokens.append(token_id)
        self.num_added += 1
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.tokens[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # incomplete character: wait for the next token
        new_text = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        start = max(0, len(self.text) - self.holdback)
        self.text += new_text
        if self.num_added > self.min_tokens:
            self._check_stop(start)

    def _check_stop(self, search_from: int) -> None:
        """Cut at the stop string that completes first when the text is read a character at a
        time: the smallest end; at one end, the longest (the earliest start)."""
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        matches = [(idx, s) for idx, s in found if idx != -1]
        if not matches:
            return
        idx, s = min(matches, key=lambda m: (m[0] + len(m[1]), m[0]))
        self.stopped_on = s
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]

    def flush(self, finished: bool) -> str:
        """Release the text that is safe to show; everything once finished."""
        end = len(self.text) if finished or self.stopped_on else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
