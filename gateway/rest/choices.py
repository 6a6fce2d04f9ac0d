"""OpenAI `choices` from the SDK's chunks: one per candidate (and per prompt), with `logprobs` in
each API's own shape, whole or as stream deltas.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. Completions (the
legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
where each position's dictionary holds the top tokens and the chosen one (as vLLM does).
Logprobs are of the raw model distribution (before penalties and temperature: vLLM's default).

With tools offered (chat only), each candidate's text goes through its own ToolCallParser:
calls become `tool_calls` (streamed as OpenAI streams them: the call's id, type and name with
empty arguments, then the arguments), the rest stays `content` (null when there is none), and a
candidate that called a function and stopped finishes with `tool_calls`, except under a named
`tool_choice`, where it finishes with `stop` (as OpenAI does). With `parallel_tool_calls: false`
only the first call is kept (as vLLM does); a call cut by max_tokens is still returned, its
arguments as far as they got, with `length` (as OpenAI does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.client import Chunk, TokenLogprob, TopLogprob
from gateway.rest.tool_calls import ToolCall, ToolCallParser

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
    parser: ToolCallParser | None = None  # tools offered: calls are parsed out of the text
    content: str = ""  # the text that is not a call (with a parser)


@dataclass(frozen=True)
class ToolParsing:
    """How calls are read out of a chat candidate's text: the functions offered, at most
    `max_calls` kept (None: all), and whether tool_choice named the function."""

    names: frozenset[str]
    max_calls: int | None = None
    named: bool = False


class Choices:
    """Choices of one prompt's candidates; `base` offsets their indexes (prompt k of a list
    with n candidates each starts at k * n, as OpenAI and vLLM number them)."""

    def __init__(self, chat: bool, logprobs: bool, base: int = 0,
                 tools: ToolParsing | None = None) -> None:
        self.chat, self.want_logprobs, self.base = chat, logprobs, base
        self.tools = tools if chat and tools is not None and tools.names else None
        self._choices: dict[int, _Choice] = {}

    def _choice(self, index: int) -> _Choice:
        if index not in self._choices:
            t = self.tools
            parser = ToolCallParser(set(t.names), t.max_calls) if t is not None else None
            self._choices[index] = _Choice(parser=parser)
        return self._choices[index]

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """Record a chunk; return its stream delta choices (none when it adds nothing)."""
        c = self._choice(chunk.index)
        if c.parser is not None:
            return self._add_parsed(c, chunk)
        offset = c.chars
        c.chars += sum(len(t.chosen.token) for t in chunk.logprobs or [])
        c.text += chunk.text
        c.logprobs += chunk.logprobs or []
        c.finish_reason = chunk.finish_reason or c.finish_reason
        if not chunk.text and not chunk.finish_reason and not (self.want_logprobs
                                                               and chunk.logprobs):
            return []
        choice: dict[str, Any] = {"index": self.base + chunk.index,
                                  "logprobs": self._logprobs(chunk.logprobs or [], offset),
                                  "finish_reason": chunk.finish_reason}
        if self.chat:
            choice["delta"] = {"content": chunk.text} if chunk.text or not chunk.finish_reason \
                else {}
        else:
            choice["text"] = chunk.text
        return [choice]

    def _add_parsed(self, c: _Choice, chunk: Chunk) -> list[dict[str, Any]]:
        """A chunk of a candidate whose text may hold tool calls: content held back while it
        may be the start of a call; the chunk's logprobs ride on its first delta."""
        assert c.parser is not None
        c.text += chunk.text
        c.logprobs += chunk.logprobs or []
        c.finish_reason = chunk.finish_reason or c.finish_reason
        events = list(c.parser.feed(chunk.text))
        if chunk.finish_reason:
            events += c.parser.finish(cut_short=chunk.finish_reason == "length")
        deltas: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "content":
                c.content += value
                deltas.append({"content": value})
            else:
                deltas += _call_deltas(len(c.parser.calls) - 1, value)
        if not deltas and (chunk.finish_reason or (self.want_logprobs and chunk.logprobs)):
            deltas.append({})
        out = []
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            out.append({"index": self.base + chunk.index, "delta": delta,
                        "logprobs": self._logprobs(chunk.logprobs or [], 0) if j == 0 else
                        self._logprobs([], 0),
                        "finish_reason": self._finish(c) if last and chunk.finish_reason
                        else None})
        return out

    def _finish(self, c: _Choice) -> str | None:
        called = c.parser is not None and bool(c.parser.calls)
        named = self.tools is not None and self.tools.named
        return "tool_calls" if called and not named and c.finish_reason == "stop" \
            else c.finish_reason

    def bodies(self, n: int) -> list[dict[str, Any]]:
        """Every candidate's whole choice (n of them, by index)."""
        out = []
        for i in range(n):
            c = self._choice(i)
            choice: dict[str, Any] = {"index": self.base + i,
                                      "logprobs": self._logprobs(c.logprobs, 0),
                                      "finish_reason": c.finish_reason}
            if c.parser is not None:
                choice["message"] = {"role": "assistant", "content": c.content or None}
                if c.parser.calls:
                    choice["message"]["tool_calls"] = [k.as_dict() for k in c.parser.calls]
                choice["finish_reason"] = self._finish(c)
            elif self.chat:
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


def _call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as OpenAI streams one: its id, type and name with empty arguments, then the
    arguments (here in one piece: a call is parsed once its block is complete)."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
