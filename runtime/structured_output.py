"""What a request's output must match: a JSON schema, any JSON object, a regex, a Lark
grammar (vLLM's `guided_json` / `guided_regex` / `guided_grammar`, OpenAI's `response_format`),
or a forced tool call (`tool_call`: the tools' definitions, see runtime/tool_grammar.py).

Only the request's description lives here, validated without the grammar engine: its kind, its
size and, for a JSON schema, that it parses and is not nested past a bound. Compiling it for the
model's vocabulary is `runtime/grammar.py`'s job (and may refuse it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from runtime.errors import InvalidArgument
from runtime.schema_bounds import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, schema_depth
from runtime.tool_grammar import check_tool_call_spec

__all__ = ["KINDS", "MAX_SCHEMA_DEPTH", "MAX_SPEC_CHARS", "InvalidStructuredOutput", "Kind",
           "StructuredOutput", "schema_depth"]

Kind = Literal["json_schema", "json_object", "regex", "grammar", "tool_call"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "tool_call")


class InvalidStructuredOutput(InvalidArgument):
    """A schema, regex or grammar that cannot constrain decoding (INVALID_ARGUMENT, HTTP 400).
    `metadata["problem"]` names the kind of problem: invalid, too_large, too_deep, unsupported."""

    def __init__(self, message: str, problem: str, field: str = "structured_output") -> None:
        super().__init__(message, field=field, problem=problem)


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` and `spec`: the JSON schema's text, a regex, or a Lark grammar; for
    `json_object`, `spec` is empty (any JSON object). Frozen and hashable, so compiled grammars
    can be cached by value."""

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidStructuredOutput(f"structured output kind must be one of {KINDS}",
                                          "invalid")
        if not isinstance(self.spec, str):
            raise InvalidStructuredOutput("structured output spec must be a string", "invalid")
        if self.kind == "tool_call":
            problem = check_tool_call_spec(self.spec)
            if problem is not None:
                raise InvalidStructuredOutput(*problem)
            return
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidStructuredOutput(
                f"{self.kind} is too large: at most {MAX_SPEC_CHARS} characters", "too_large")
        if self.kind == "json_object":
            if self.spec:
                raise InvalidStructuredOutput("json_object takes no spec", "invalid")
        elif not self.spec:
            raise InvalidStructuredOutput(f"{self.kind} needs a non-empty spec", "invalid")
        if self.kind == "json_schema":
            schema = _parse_schema(self.spec)
            if schema_depth(schema) > MAX_SCHEMA_DEPTH:
                raise InvalidStructuredOutput(
                    f"json_schema is nested too deeply: at most {MAX_SCHEMA_DEPTH} levels",
                    "too_deep")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        if isinstance(schema, dict):
            schema = json.dumps(schema, separators=(",", ":"), sort_keys=True)
        return cls("json_schema", schema)


def _parse_schema(spec: str) -> Any:
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError):
        raise InvalidStructuredOutput("json_schema is not valid JSON", "invalid") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidStructuredOutput("json_schema must be a JSON object", "invalid")
    return schema
