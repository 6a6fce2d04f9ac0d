"""The tool-call validity harness's own parts: the fixed request set, the scorer and the Wilson
interval (the runs themselves are in ops/bench/RESULTS.md#tool-call-validity)."""

from __future__ import annotations

import json

import pytest

from ops.eval.tool_calls import conversations, score, wilson
from ops.eval.tool_prompts import FUNCTIONS, REQUESTS, offered

jsonschema = pytest.importorskip("jsonschema")


def _call(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_every_request_is_offered_its_own_function_among_three_valid_schemas() -> None:
    assert len(REQUESTS) == 60
    for name, (_, schema) in FUNCTIONS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert sum(expected == name for expected, _ in REQUESTS) == 5
    for i, (expected, _) in enumerate(REQUESTS):
        assert len(set(offered(i))) == 3 and expected in offered(i)
    assert {offered(i).index(REQUESTS[i][0]) for i in range(len(REQUESTS))} == {0, 1, 2}


def test_conversations_render_the_tools_as_the_shim_does() -> None:
    messages, names, expected = conversations()[0]
    assert expected == REQUESTS[0][0]
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert all(f'"name": "{n}"' in messages[0]["content"] for n in names)
    assert messages[-1] == {"role": "user", "content": REQUESTS[0][1]}


@pytest.mark.parametrize(("text", "outcome", "right"), [
    (_call("get_weather", {"city": "Lisbon"}), "valid", True),
    ("Sure. " + _call("add_numbers", {"a": 1, "b": 2}), "valid", False),
    (_call("get_weather", {"city": 3}), "invalid", False),  # fails the schema
    (_call("get_weather", {"city": "Oslo", "extra": 1}), "invalid", False),  # closed object
    (_call("Lisbon", {"city": "Lisbon"}), "invalid", False),  # no such function
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ", "invalid", False),
    ("It is sunny in Lisbon.", "no_call", False),
])
def test_score_reads_a_call_the_way_the_shim_parses_it(text, outcome, right) -> None:
    s = score(text, ["get_weather", "add_numbers", "send_email"], "get_weather")
    assert (s.outcome, s.right_function) == (outcome, right), s.detail


def test_wilson_interval_matches_known_values() -> None:
    lo, hi = wilson(0, 60)
    assert lo == 0.0 and hi == pytest.approx(0.0602, abs=1e-4)
    lo, hi = wilson(30, 60)
    assert (lo, hi) == (pytest.approx(0.3773, abs=1e-4), pytest.approx(0.6227, abs=1e-4))
    assert wilson(0, 0) == (0.0, 1.0)
