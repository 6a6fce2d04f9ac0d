"""Request bodies for structured output and tools (OpenAI's `response_format`, `tools`,
`tool_choice`), strict like the rest of gateway/rest/schemas.py.

A schema is checked here for what needs no grammar engine (JSON, size, nesting: a typed 400
before any worker is asked); the worker's grammar engine refuses what does not compile (an
unknown type, a dangling `$ref`), also as a 400 naming the problem. A schema is always a
constraint here, as in vLLM; `strict: true` adds OpenAI's strict rules to it (no keys beyond
those listed, every listed key required: gateway/rest/strict_schema.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.rest.strict import Strict, Text
from gateway.rest.strict_schema import strict_schema
from runtime.errors import InvalidArgument
from runtime.structured_output import InvalidStructuredOutput, StructuredOutput

MAX_TOOLS = 128
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class JsonSchemaFormat(Strict):
    name: FunctionName
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint (None for text); InvalidArgument (param `response_format`) when the
        schema is missing, too large or nested too deeply."""
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidArgument("response_format: json_schema is required with type "
                                  "'json_schema', and only then", field="response_format")
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None:
            return None
        try:
            schema = self.json_schema.schema_ or {}
            StructuredOutput.json_schema(schema)  # bounded before strict mode walks it
            if self.json_schema.strict:
                schema = strict_schema(schema, "response_format")
            return StructuredOutput("json_schema", schema_text(schema))
        except InvalidStructuredOutput as e:
            raise InvalidStructuredOutput(f"response_format: {e.message}",
                                          e.metadata["problem"], "response_format") from None


class FunctionDef(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def raw_parameters(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}

    def parameters_schema(self) -> dict[str, Any]:
        """The parameters as they constrain a call: with `strict`, OpenAI's strict rules
        applied (call after `ToolFields.check_tools` has bounded them)."""
        if self.strict:
            return strict_schema(self.raw_parameters(), "tools")
        return self.raw_parameters()


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(Strict):
    name: Text
    arguments: Text


class ToolCallIn(Strict):
    """A tool call the assistant made in an earlier turn, sent back in `messages`."""

    id: Text
    type: Literal["function"]
    function: ToolCallFunction


class ToolFields(Strict):
    """The chat request's tool fields. `check_tools` checks them together (names unique, a
    named choice known, schemas bounded): rules a JSON schema cannot state, refused as 400
    INVALID_ARGUMENT with param `tools`, `tool_choice` or `response_format`."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise InvalidArgument(f"tools: duplicate function name {name!r}", field="tools")
            seen.add(name)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise InvalidArgument("tool_choice names a function that is not in tools",
                                  field="tool_choice")
        if choice is not None and choice != "none" and not names:
            raise InvalidArgument("tool_choice needs tools", field="tool_choice")
        if self.forced_tools() and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidArgument("response_format cannot be combined with a required tool "
                                  "call", field="response_format")
        for tool in self.tools or ():
            try:
                StructuredOutput.json_schema(tool.function.raw_parameters())
                tool.function.parameters_schema()
            except InvalidStructuredOutput as e:
                raise InvalidStructuredOutput(
                    f"tools: {tool.function.name}'s parameters: {e.message}",
                    e.metadata["problem"], "tools") from None

    def active_tools(self) -> list[FunctionDef]:
        """The functions the model is told about (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function for t in self.tools]

    def forced_tools(self) -> list[FunctionDef]:
        """The functions a call must be made to ("required": any; named: that one), else []."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return [t.function for t in self.tools or () if t.function.name == choice.function.name]
        if choice == "required":
            return [t.function for t in self.tools or ()]
        return []
