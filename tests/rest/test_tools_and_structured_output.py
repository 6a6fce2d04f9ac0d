"""Tool calling and `response_format` through the official `openai` client, against the real
gateway, a real worker process and the default model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from runtime.structured_output import MAX_SCHEMA_DEPTH
from tests.rest.conftest import KEYS, MODEL, Shim

jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                   "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                  "b": {"type": "integer", "minimum": -999, "maximum": 999}}}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# Small schemas of varied shape, every one bounded (enums, small integers, short strings) so that
# 48 tokens always hold a complete answer.
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
     "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "maxLength": 8}}}},
    {"type": "object", "additionalProperties": False, "required": ["point"],
     "properties": {"point": {"type": "object", "additionalProperties": False,
                              "required": ["x", "y"],
                              "properties": {"x": {"type": "integer", "maximum": 99,
                                                   "minimum": -99},
                                             "y": {"type": "integer", "maximum": 99,
                                                   "minimum": -99}}}}},
    {"type": "object", "additionalProperties": False, "required": ["city", "rating"],
     "properties": {"city": {"type": "string", "maxLength": 10},
                    "rating": {"type": "integer", "minimum": 1, "maximum": 5}}},
]
SUBJECTS = ["a cat", "Paris", "the number seven", "a rainy day", "an old castle",
            "a red car", "the moon", "a teacher", "a small village", "a cup of tea"]


@pytest.fixture(scope="module")
def oai(shim: Shim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim.url}/v1", api_key=KEYS["acme"], max_retries=0,
                         timeout=300)


def test_json_schema_strict_output_validates_for_50_varied_prompts(oai) -> None:
    def ask(i: int) -> tuple[dict, str, str | None]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        done = oai.chat.completions.create(
            model=MODEL, max_tokens=48, temperature=0.8, seed=i,
            messages=[{"role": "user", "content": f"Describe {SUBJECTS[i // 5]} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": f"shape_{i % len(SCHEMAS)}", "schema": schema, "strict": True}})
        choice = done.choices[0]
        return schema, choice.message.content or "", choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    for schema, text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len({text for _, text, _ in answers}) > 25  # varied prompts, varied answers


def test_completions_take_response_format_json_object(oai) -> None:
    done = oai.completions.create(model=MODEL, prompt="A JSON object describing a dog:",
                                  max_tokens=48, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert done.choices[0].text.startswith("{")


def _check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


def test_tool_call_round_trip_named_then_the_result_answered(oai) -> None:
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = oai.chat.completions.create(
        model=MODEL, messages=question, tools=TOOLS, max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, "get_weather")
    turn = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = oai.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS,
                                        tool_choice="none", max_tokens=24, temperature=0)
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


def test_streamed_required_tool_call_arrives_as_openai_deltas(oai) -> None:
    messages = [{"role": "user", "content": "Add 12 and 30 with the tool."}]
    kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=48, temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] = (d.function.name if d.function and d.function.name
                             else entry["name"])
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.finish_reason
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for e in calls.values():
        assert e["id"].startswith("call_")
        jsonschema.validate(json.loads(e["arguments"]), PARAMS[e["name"]])


def test_tool_call_stream_with_the_openai_helper_accumulates(oai) -> None:
    with oai.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=48, temperature=0) as stream:
        done = stream.get_final_completion()
    _check_call(done.choices[0].message.tool_calls[0], "get_weather")


DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize(("body", "names"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
     "nested too deeply"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 40_000}}}},
     "too large"),
    ({"tools": [WEATHER, WEATHER]}, "duplicate function name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_schemas_and_tools_are_a_typed_400_and_harm_nothing(oai, body, names) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, max_tokens=4,
                                    messages=[{"role": "user", "content": "Hi"}],
                                    extra_body=body)
    error = info.value.body
    assert info.value.status_code == 400
    assert names in error["message"], error
    assert error["code"] == "invalid_argument"
    ok = oai.chat.completions.create(model=MODEL, max_tokens=2,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].finish_reason in ("stop", "length")
