"""The bounds on a constraint's text: a schema, regex or grammar is compiled against the whole
vocabulary before the request runs, so its size and a schema's nesting are bounded and no
request can make that cost unbounded. A tool_call spec has its own bounds
(runtime/tool_grammar.py): each function's parameters bounded as a schema is, and all of them
together by MAX_TOOL_CALL_SPEC_CHARS."""

from __future__ import annotations

from typing import Any

MAX_SPEC_CHARS = 32_768
MAX_SCHEMA_DEPTH = 64  # levels of JSON nesting in the schema document


def schema_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar is 0), iteratively so that
    a hostile document cannot exhaust the Python stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node \
            if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
