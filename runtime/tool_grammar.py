"""The grammar that forces a tool call (StructuredOutput kind `tool_call`): the server's own
grammar for OpenAI's `tool_choice` "required" or a named function, built here from the tools'
definitions so that its bound is theirs, not the bound on a client's Lark grammar.

The markup is the Hermes format (`gateway/rest/tool_calls.py` says why): each call is
`<tool_call>\\n{"name": "<function>", "arguments": <object>}\\n</tool_call>`, several separated by
one newline when `several`. Each function's parameters are their own `%json` rule, so a schema's
`$ref` pointers (`#/$defs/City`, what Pydantic and zod emit) resolve against that schema's root.

The spec is JSON: `{"functions": [{"name": str, "parameters": object}, ...], "several": bool}`.
Bounds (`check_tool_call_spec`): at most MAX_FUNCTIONS functions, each name 1-64 of
`[A-Za-z0-9_-]`, each function's parameters at most MAX_SPEC_CHARS characters and
MAX_SCHEMA_DEPTH levels deep, the spec at most MAX_TOOL_CALL_SPEC_CHARS characters in all.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.schema_bounds import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, schema_depth

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_FUNCTIONS = 128
MAX_TOOL_CALL_SPEC_CHARS = 262_144  # every function's definition together
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# JSON is written as json.dumps writes it (see runtime/grammar.py for why).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_spec(functions: list[tuple[str, dict[str, Any]]], several: bool) -> str:
    """The spec's text for (name, parameters schema) pairs."""
    return json.dumps({"functions": [{"name": n, "parameters": p} for n, p in functions],
                       "several": several}, separators=(",", ":"), ensure_ascii=False)


def check_tool_call_spec(spec: str) -> tuple[str, str] | None:
    """What is wrong with a spec, as (message, problem) where problem is invalid, too_large or
    too_deep; None when it is well formed. Needs no grammar engine."""
    if len(spec) > MAX_TOOL_CALL_SPEC_CHARS:
        return (f"tool definitions are too large: at most {MAX_TOOL_CALL_SPEC_CHARS} "
                "characters in all", "too_large")
    try:
        value = json.loads(spec)
    except (ValueError, RecursionError):
        return ("tool_call spec is not valid JSON", "invalid")
    functions = value.get("functions") if isinstance(value, dict) else None
    if not isinstance(functions, list) or not functions \
            or not isinstance(value.get("several"), bool):
        return ("tool_call spec needs a non-empty `functions` list and a boolean `several`",
                "invalid")
    if len(functions) > MAX_FUNCTIONS:
        return (f"tool_call spec has more than {MAX_FUNCTIONS} functions", "too_large")
    for f in functions:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not _NAME.match(f["name"]) or not isinstance(f.get("parameters"), dict):
            return ("tool_call spec: each function needs a name of 1-64 [A-Za-z0-9_-] and an "
                    "object of parameters", "invalid")
        name, params = f["name"], f["parameters"]
        if len(json.dumps(params, ensure_ascii=False)) > MAX_SPEC_CHARS:
            return (f"{name}'s parameters are too large: at most {MAX_SPEC_CHARS} characters",
                    "too_large")
        if schema_depth(params) > MAX_SCHEMA_DEPTH:
            return (f"{name}'s parameters are nested too deeply: at most {MAX_SCHEMA_DEPTH} "
                    "levels", "too_deep")
    return None


def tool_call_lark(spec: str) -> str:
    """The Lark grammar (llguidance's dialect) for a spec that `check_tool_call_spec` passed."""
    value = json.loads(spec)
    names, rules = [], []
    for i, f in enumerate(value["functions"]):
        head = json.dumps(f'{{"name": "{f["name"]}", "arguments": ')
        params = {**f["parameters"], "x-guidance": JSON_STYLE}  # ours wins over the client's
        names.append(f"f{i}")
        rules += [f'f{i}: {head} a{i} "}}"',
                  f"a{i}: %json {json.dumps(params, ensure_ascii=False)}"]
    repeat = ' ("\\n" call)*' if value["several"] else ""
    return "\n".join([f"start: call{repeat}",
                      f'call: {json.dumps(OPEN + chr(10))} ({" | ".join(names)}) '
                      f'{json.dumps(chr(10) + CLOSE)}', *rules]) + "\n"
