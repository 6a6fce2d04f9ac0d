"""Tool calling for chat: how tools and earlier calls are written into the conversation, the
grammar that forces a call, and the parser that turns the model's text back into `tool_calls`.

The default model's chat template (SmolLM2's ChatML) has no tool format, so tessera uses the
widely trained Hermes format (Qwen 2.5's and NousResearch Hermes' templates; vLLM's `hermes`
parser) as its documented default:

- the tools are listed in the system message, one JSON object per line, inside
  `<tools></tools>`, with an instruction to answer calls as below;
- the model calls a function by writing `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, once per call (several in a row when parallel calls are allowed);
- an assistant turn that made calls is sent back with those blocks as its content, and each
  `role: "tool"` result as a user turn `<tool_response>\\n...\\n</tool_response>` (adjacent results
  in one turn, in order).

With `tool_choice` "required" or a named function, decoding is constrained by the `tool_call`
grammar (runtime/tool_grammar.py): the name is one of the allowed functions and the arguments
match that function's parameters, so the call always parses and validates.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.rest.structured import FunctionDef, ToolFields
from runtime.structured_output import InvalidStructuredOutput, StructuredOutput
from runtime.tool_grammar import CLOSE, OPEN, tool_call_spec

SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query."
    " Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def render_messages(messages: list[dict[str, Any]], fields: ToolFields) -> list[dict[str, str]]:
    """The conversation as plain role/content turns in the Hermes format (see above)."""
    tools = fields.active_tools()
    out: list[dict[str, str]] = []
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": _function_json(f)},
                                       ensure_ascii=False) for f in tools)
        system = SYSTEM_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        content = m["content"]
        calls = m.get("tool_calls") or []
        if calls:
            blocks = [f"{OPEN}\n" + json.dumps(
                {"name": c["function"]["name"],
                 "arguments": _arguments(c["function"]["arguments"])},
                ensure_ascii=False) + f"\n{CLOSE}" for c in calls]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": m["role"], "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _function_json(f: FunctionDef) -> dict[str, Any]:
    body: dict[str, Any] = {"name": f.name}
    if f.description:
        body["description"] = f.description
    body["parameters"] = f.parameters_schema()
    return body


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # sent back as the model wrote it


def forcing_grammar(fields: ToolFields) -> StructuredOutput | None:
    """For "required" or a named function: the `tool_call` constraint (runtime/tool_grammar.py)
    admitting only tool-call blocks whose JSON names an allowed function and carries arguments
    valid for its parameters. InvalidStructuredOutput (param `tools`) past the tools' bounds."""
    forced = fields.forced_tools()
    if not forced:
        return None
    # A named function is called once (as vLLM does); "required" may call several in a row.
    several = fields.tool_choice == "required" and fields.parallel_tool_calls is not False
    spec = tool_call_spec([(f.name, f.parameters_schema()) for f in forced], several)
    try:
        return StructuredOutput("tool_call", spec)
    except InvalidStructuredOutput as e:
        raise InvalidStructuredOutput(f"tools: {e.message}", e.metadata["problem"],
                                      "tools") from None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it (cut short when the output was)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Incremental: text in, ("content", text) and ("call", ToolCall) events out.

    A call is `<tool_call>` JSON `</tool_call>`, where the closing tag is the first one outside
    a JSON string (a literal `</tool_call>` inside an argument stays in the argument). Text that
    may begin a block is held back until it is known not to, and so is whitespace until
    something else follows it: whitespace around calls is never content. A block that does not
    parse as a call to a known function is passed on as content. With `max_calls` (OpenAI's
    `parallel_tool_calls: false` is 1), calls past it are dropped."""

    def __init__(self, names: set[str], max_calls: int | None = None) -> None:
        self.names, self.max_calls = names, max_calls
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self._scan = _CloseScanner()

    def feed(self, text: str) -> Iterator[tuple[str, Any]]:
        self.buffer += text
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content = self.buffer[: len(self.buffer) - keep]
                if content.strip():
                    self.buffer = self.buffer[len(content):]
                    yield "content", content
                return
            end = self._scan.find(self.buffer, start + len(OPEN))
            if end < 0:
                if self.buffer[:start].strip():
                    yield "content", self.buffer[:start]
                    self.buffer = self.buffer[start:]
                    self._scan = _CloseScanner()
                return
            before, block = self.buffer[:start], self.buffer[start + len(OPEN): end]
            self.buffer = self.buffer[end + len(CLOSE):]
            self._scan = _CloseScanner()
            call = self._parse(block)
            if before.strip() or (before and call is None and not self.calls):
                yield "content", before
            if call is None:
                yield "content", OPEN + block + CLOSE
            elif self._room():
                self.calls.append(call)
                yield "call", call

    def finish(self, cut_short: bool = False) -> Iterator[tuple[str, Any]]:
        """The rest of the text at the end of the output. `cut_short` (finish_reason "length"):
        an unclosed call to a known function is still a call, its arguments as far as they got
        (as OpenAI returns a call cut by max_tokens); otherwise unclosed markup is content."""
        rest, self.buffer = self.buffer, ""
        start = rest.find(OPEN)
        if cut_short and start >= 0 and self._room():
            call = self._parse_unclosed(rest[start + len(OPEN):])
            if call is not None:
                if rest[:start].strip():
                    yield "content", rest[:start]
                self.calls.append(call)
                yield "call", call
                return
        if rest and (not self.calls or rest.strip()):
            yield "content", rest

    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _parse(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        args = value.get("arguments", {})
        if isinstance(args, str):
            return ToolCall(value["name"], args)
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))

    def _parse_unclosed(self, block: str) -> ToolCall | None:
        whole = self._parse(block)
        if whole is not None:
            return whole
        head = _CALL_HEAD.match(block)
        if head is None or head.group(1) not in self.names:
            return None
        return ToolCall(head.group(1), block[head.end():].rstrip() if head.group(2) else "")


# A cut call's head: its name complete, then (when the output got that far) its arguments' key.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"(\s*,\s*"arguments"\s*:\s*)?')


class _CloseScanner:
    """Finds the first CLOSE outside a JSON string, resuming where its last call stopped (a
    block's text only grows until it is consumed, so each character is scanned once)."""

    def __init__(self) -> None:
        self.pos = 0
        self.in_string = self.escaped = False

    def find(self, text: str, start: int) -> int:
        i = max(self.pos, start)
        # NOTE: a character is scanned once its CLOSE-sized window is all there, so a tag split
        # across chunks is seen whole on a later call.
        stop = len(text) - len(CLOSE) + 1
        while i < stop:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "<" and text.startswith(CLOSE, i):
                return i
            i += 1
        self.pos = max(i, start)
        return -1


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
