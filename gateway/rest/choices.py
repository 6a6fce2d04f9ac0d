"""OpenAI `choices` from the SDK's chunks: one per candidate (and per prompt), with `logprobs` in
each API's own shape, whole or as stream deltas.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. Completions (the
legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
where each position's dictionary holds the top tokens and the chosen one (as vLLM does).
Logprobs are of the raw model distribution (before penalties and temperature: vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.client import Chunk, TokenLogprob, TopLogprob

# JSON has no -inf: a token the model rules out is reported at vLLM's floor.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def _chat_entry(t: TopLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes)}


@dataclass
class _Choice:
    text: str = ""
    chars: int = 0  # characters of the tokens' own texts so far (completions' text_offset)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Choices:
    """Choices of one prompt's candidates; `base` offsets their indexes (prompt k of a list
    with n candidates each starts at k * n, as OpenAI and vLLM number them)."""

    def __init__(self, chat: bool, logprobs: bool, base: int = 0) -> None:
        self.chat, self.want_logprobs, self.base = chat, logprobs, base
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: Chunk) -> dict[str, Any] | None:
        """Record a chunk; return its stream delta choice, or None when it adds nothing."""
        c = self._choices.setdefault(chunk.index, _Choice())
        offset = c.chars
        c.chars += sum(len(t.chosen.token) for t in chunk.logprobs or [])
        c.text += chunk.text
        c.logprobs += chunk.logprobs or []
        c.finish_reason = chunk.finish_reason or c.finish_reason
        if not chunk.text and not chunk.finish_reason and not (self.want_logprobs
                                                               and chunk.logprobs):
            return None
        choice: dict[str, Any] = {"index": self.base + chunk.index,
                                  "logprobs": self._logprobs(chunk.logprobs or [], offset),
                                  "finish_reason": chunk.finish_reason}
        if self.chat:
            choice["delta"] = {"content": chunk.text} if chunk.text or not chunk.finish_reason \
                else {}
        else:
            choice["text"] = chunk.text
        return choice

    def bodies(self, n: int) -> list[dict[str, Any]]:
        """Every candidate's whole choice (n of them, by index)."""
        out = []
        for i in range(n):
            c = self._choices.get(i, _Choice())
            choice: dict[str, Any] = {"index": self.base + i,
                                      "logprobs": self._logprobs(c.logprobs, 0),
                                      "finish_reason": c.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            out.append(choice)
        return out

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": [{**_chat_entry(t.chosen),
                                 "top_logprobs": [_chat_entry(x) for x in t.top]}
                                for t in lps]}
        offsets = []
        for t in lps:
            offsets.append(offset)
            offset += len(t.chosen.token)
        return {"tokens": [t.chosen.token for t in lps],
                "token_logprobs": [_lp(t.chosen.logprob) for t in lps],
                "top_logprobs": [{**{x.token: _lp(x.logprob) for x in t.top},
                                  t.chosen.token: _lp(t.chosen.logprob)} for t in lps],
                "text_offset": offsets}
