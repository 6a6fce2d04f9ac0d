"""Tool calling and `response_format` through the official `openai` client, against the real
gateway, a real worker process and the default model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.client import Client
from runtime.errors import InvalidArgument
from runtime.structured_output import MAX_SCHEMA_DEPTH, StructuredOutput
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


def _answer_turn(question: list[dict], call) -> list[dict]:
    """The conversation sent back: the question, the assistant's call, the tool's result."""
    return [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 18, "sky": "sunny"})}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip_call_then_result_then_answer(oai, stream) -> None:
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    if stream:  # the openai helper accumulates the streamed deltas into a completion
        with oai.chat.completions.stream(model=MODEL, messages=question, tools=TOOLS,
                                         tool_choice=named, max_tokens=48,
                                         temperature=0) as events:
            first = events.get_final_completion()
    else:
        first = oai.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                            tool_choice=named, max_tokens=48, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a function the client named
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, "get_weather")
    kwargs = dict(model=MODEL, messages=_answer_turn(question, call), tools=TOOLS,
                  tool_choice="none", max_tokens=24, temperature=0)
    if stream:
        chunks = list(oai.chat.completions.create(**kwargs, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        answer = oai.chat.completions.create(**kwargs).choices[0]
        content, finish = answer.message.content, answer.finish_reason
        assert not answer.message.tool_calls
    assert content and content.strip()
    assert finish in ("stop", "length")


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


def test_grpc_sdk_takes_a_regex_and_refuses_a_bad_one_typed(shim) -> None:
    with Client(shim.runner.target, api_key=KEYS["acme"]) as client:
        text = "".join(c.text for c in client.generate(
            "Answer yes or no:", model=MODEL, max_tokens=16, temperature=0,
            structured_output=StructuredOutput("regex", r"(yes|no)\.")))
        assert text in ("yes.", "no.")
        with pytest.raises(InvalidArgument) as info:
            list(client.generate("Hi", model=MODEL, max_tokens=4,
                                 structured_output=StructuredOutput("regex", "[a-")))
        assert info.value.metadata.get("field") == "structured_output"


DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "array", "items": DEEP}


BAD_PARAMETERS = {"type": "object", "properties": {"x": {"type": "strin"}}}
BAD = [  # (route, body, param, words the message must hold)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "structured_output", "json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}}, "response_format", "nested too deeply"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 40_000}}}},
     "response_format", "too large"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format",
     "json_schema is required"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}}, "response_format", "nested too deeply"),
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": BAD_PARAMETERS}}], "tool_choice": "required"},
     "structured_output", "invalid tool_call"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
     "tools", "nested too deeply"),
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "description": "x" * 40_000}}}]},
     "tools", "too large"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "duplicate function name"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
]


def test_bad_schemas_and_tools_are_typed_400s_and_harm_nothing_in_flight(oai) -> None:
    """Every refusal is a 400 naming its param and problem while a greedy request streams on
    the same worker; that request ends exactly as it does alone."""
    ask = dict(model=MODEL, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    alone = oai.completions.create(prompt="Once upon a time", **ask).choices[0].text
    running = iter(oai.completions.create(prompt="Once upon a time", stream=True, **ask))
    pieces = [next(running).choices[0].text]
    for route, body, param, words in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            if route == "chat":
                oai.chat.completions.create(model=MODEL, max_tokens=4, extra_body=body,
                                            messages=[{"role": "user", "content": "Hi"}])
            else:
                oai.completions.create(model=MODEL, max_tokens=4, prompt="Hi",
                                       extra_body=body)
        error = info.value.body
        assert info.value.status_code == 400
        assert (error["code"], error["param"]) == ("invalid_argument", param), error
        assert words in error["message"], error
        assert len(error["message"]) < 400  # never echoes the schema
    pieces += [c.choices[0].text for c in running]
    assert "".join(pieces) == alone
