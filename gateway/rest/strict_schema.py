"""OpenAI's `strict: true` for a function's parameters or a `response_format` json_schema: every
object admits only the keys it lists (`additionalProperties: false`) and requires all of them
(OpenAI's structured-output rules, "Supported schemas": additionalProperties must be false and
every field required; optional fields are spelled as a union with null).

Where a schema leaves these unsaid they are filled in; where it says otherwise
(`additionalProperties` anything but false, `required` missing a listed key) it is refused as
OpenAI refuses it: a 400 naming the path of the offending object.
"""

from __future__ import annotations

from typing import Any

from runtime.structured_output import InvalidStructuredOutput

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "not", "if", "then", "else", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "$defs", "definitions")


def strict_schema(schema: dict[str, Any], field: str) -> dict[str, Any]:
    """A copy of `schema` with OpenAI's strict rules applied to every object in it (nested
    ones, `$defs` included); InvalidStructuredOutput (problem `invalid`, param `field`) where
    the schema contradicts them. The schema is already bounded in size and depth."""
    return _strict(schema, "#", field)


def _strict(node: Any, path: str, field: str) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], f"{path}/{key}", field)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, f"{path}/{key}/{i}", field) for i, s in enumerate(out[key])]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _strict(s, f"{path}/{key}/{k}", field) for k, s in out[key].items()}
    if _is_object(out):
        keys = list(out.get("properties") or {})
        if out.setdefault("additionalProperties", False) is not False:
            raise InvalidStructuredOutput(
                f"strict mode: additionalProperties must be false at {path[:120]}",
                "invalid", field)
        required = out.setdefault("required", keys)
        missing = [k for k in keys if not isinstance(required, list) or k not in required]
        if missing:
            raise InvalidStructuredOutput(
                f"strict mode: every property must be required at {path[:120]} "
                f"(missing {missing[0][:40]!r}; make it optional with a null type instead)",
                "invalid", field)
    return out


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) \
        or "properties" in node
