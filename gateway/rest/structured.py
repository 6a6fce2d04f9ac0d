"""Request bodies for structured output and tools (OpenAI's `response_format`, `tools`,
`tool_choice`), strict like the rest of gateway/rest/schemas.py.

A schema is checked here for what needs no grammar engine (JSON, size, nesting: a typed 400
before any worker is asked); the worker's grammar engine refuses what does not compile (an
unknown type, a dangling `$ref`), also as a 400 naming the problem. `strict: false` is accepted
and enforced all the same, as vLLM does: a schema is always a constraint here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.rest.strict import Strict, Text
from runtime.structured_output import StructuredOutput

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

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        self.structured_output()  # size and nesting: InvalidStructuredOutput is a ValueError
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema" and self.json_schema is not None:
            return StructuredOutput("json_schema", schema_text(self.json_schema.schema_ or {}))
        return None


class FunctionDef(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


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
    """The chat request's tool fields, checked together: names unique, a named choice known."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tools_agree(self) -> ToolFields:
        names = [t.function.name for t in self.tools or ()]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"tools: duplicate function name {name!r}")
            seen.add(name)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise ValueError("tool_choice names a function that is not in tools")
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if self.forced_tools() and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with a required tool call")
        for tool in self.tools or ():
            StructuredOutput.json_schema(tool.function.parameters_schema())  # size and nesting
        return self

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
