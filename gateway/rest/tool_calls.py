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

With `tool_choice` "required" or a named function, decoding is constrained by a Lark grammar
whose call bodies are llguidance `%json` schemas: the name is one of the allowed functions and
the arguments match that function's parameters, so the call always parses and validates.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.rest.structured import FunctionDef, ToolFields, schema_text
from runtime.structured_output import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query."
    " Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
# The grammar writes JSON as json.dumps does (see runtime/grammar.py for why).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
    """For "required" or a named function: a Lark grammar admitting only tool-call blocks whose
    JSON names an allowed function and carries arguments valid for its parameters."""
    forced = fields.forced_tools()
    if not forced:
        return None
    call_schema = {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": f.name}, "arguments": f.parameters_schema()}}
        for f in forced], "x-guidance": _JSON_STYLE}
    # A named function is called once (as vLLM does); "required" may call several in a row.
    several = fields.tool_choice == "required" and fields.parallel_tool_calls is not False
    repeat = ' ("\\n" call)*' if several else ""
    lark = (f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {schema_text(call_schema)}\n")
    return StructuredOutput("grammar", lark)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Incremental: text in, ("content", text) and ("call", ToolCall) events out. Text that may
    begin a `<tool_call>` block is held back until it is known not to; a block that does not
    parse as a call to a known function is passed on as content."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Iterator[tuple[str, Any]]:
        self.buffer += text
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content, self.buffer = self.buffer[: len(self.buffer) - keep], \
                    self.buffer[len(self.buffer) - keep:]
                if content:
                    yield "content", content
                return
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                if self.buffer[:start].strip():
                    yield "content", self.buffer[:start]
                    self.buffer = self.buffer[start:]
                return
            before, block = self.buffer[:start], self.buffer[start + len(OPEN): end]
            self.buffer = self.buffer[end + len(CLOSE):]
            call = self._parse(block)
            if before.strip() or (before and call is None):
                yield "content", before
            if call is None:
                yield "content", OPEN + block + CLOSE
            else:
                self.calls.append(call)
                yield "call", call

    def finish(self) -> Iterator[tuple[str, Any]]:
        rest, self.buffer = self.buffer, ""
        if rest and (not self.calls or rest.strip()):
            yield "content", rest

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


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
