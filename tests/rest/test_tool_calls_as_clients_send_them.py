"""Tool calling and strict structured output as real clients use them (issue 33, items 6-11),
through the official `openai` client, the real gateway, a real worker process and the default
model: Pydantic-style `$defs`, tags inside arguments, `strict`, `parallel_tool_calls`, many
tools, several calls."""

from __future__ import annotations

import json

import openai
import pytest

from tests.rest.conftest import KEYS, MODEL, Shim

jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What Pydantic emits for `class Trip(BaseModel): city: City` with a nested `City` model.
TRIP = {"type": "object", "title": "Trip", "additionalProperties": False, "required": ["city"],
        "$defs": {"City": {"type": "object", "title": "City", "additionalProperties": False,
                           "required": ["name", "country"],
                           "properties": {"name": {"type": "string", "maxLength": 20},
                                          "country": {"enum": ["FR", "DE", "JP"]}}}},
        "properties": {"city": {"$ref": "#/$defs/City"}}}
BOOK = {"type": "function", "function": {"name": "book_trip", "description": "Book a trip.",
                                         "parameters": TRIP}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                   "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                  "b": {"type": "integer", "minimum": -999, "maximum": 999}}}}}
ECHO_TAG = {"type": "function", "function": {
    "name": "echo_tag", "description": "Echo an XML tag.",
    "parameters": {"type": "object", "required": ["tag", "n"], "additionalProperties": False,
                   "properties": {"tag": {"const": "</tool_call>"},
                                  "n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _calls(pairs: list[tuple[int, int]], tag: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{tag}{k}", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
        for k, (a, b) in enumerate(pairs)]}


# Two worked examples of two calls in one turn: greedy, the model then makes two calls itself.
TWO_SUMS = [{"role": "user", "content": "Add 1 and 2, and add 5 and 6."},
            _calls([(1, 2), (5, 6)], "x"),
            {"role": "user", "content": "Add 10 and 20, and add 30 and 40."},
            _calls([(10, 20), (30, 40)], "y"),
            {"role": "user", "content": "Add 3 and 4, and add 7 and 8."}]


@pytest.fixture(scope="module")
def oai(shim: Shim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim.url}/v1", api_key=KEYS["acme"], max_retries=0,
                         timeout=300)


def ask(oai: openai.OpenAI, **kwargs):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 64, **kwargs}
    return oai.chat.completions.create(**kwargs).choices[0]


def streamed(oai: openai.OpenAI, **kwargs) -> tuple[list[str], dict[int, dict], str | None]:
    """The content deltas, the calls put together from their deltas, the last finish_reason."""
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 64, **kwargs}
    contents, calls, finish = [], {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        if delta.content:
            contents.append(delta.content)
        for d in delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function and d.function.name:
                entry["name"] = d.function.name
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return contents, calls, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_to_a_tool_whose_parameters_use_defs_and_ref(oai, choice) -> None:
    """Item 6: Pydantic's `$defs` / `$ref` resolve in the forcing grammar."""
    done = ask(oai, messages=[{"role": "user", "content": "Book me a trip to Paris."}],
               tools=[BOOK, ADD], tool_choice=named("book_trip") if choice == "named"
               else "required", parallel_tool_calls=False)
    assert done.message.content is None
    assert [c.function.name for c in done.message.tool_calls] == ["book_trip"]
    jsonschema.validate(json.loads(done.message.tool_calls[0].function.arguments), TRIP)
    # OpenAI: a call the client named finishes with "stop", one the model chose "tool_calls".
    assert done.finish_reason == ("stop" if choice == "named" else "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_closing_tag_inside_an_argument_stays_in_the_argument(oai, stream) -> None:
    """Item 7: the call ends where its JSON ends, not at the first `</tool_call>`."""
    request = dict(messages=[{"role": "user", "content": "Echo the closing tag."}],
                   tools=[ECHO_TAG], tool_choice=named("echo_tag"))
    if stream:
        contents, calls, finish = streamed(oai, **request)
        assert contents == [] and len(calls) == 1
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        done = ask(oai, **request)
        assert done.message.content is None and len(done.message.tool_calls) == 1
        name, arguments = (done.message.tool_calls[0].function.name,
                           done.message.tool_calls[0].function.arguments)
        finish = done.finish_reason
    assert name == "echo_tag" and json.loads(arguments)["tag"] == "</tool_call>"
    assert finish == "stop"


LOOSE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                          "days": {"type": "integer", "minimum": 1,
                                                   "maximum": 7}}}


def test_strict_tool_parameters_take_exactly_their_listed_keys(oai) -> None:
    """Item 8: `strict: true` means every listed key, and no other; the forced call closes."""
    tool = {"type": "function", "function": {"name": "plan", "description": "Plan a stay.",
                                             "parameters": LOOSE, "strict": True}}
    for city in ("Paris", "Kyoto", "Lima", "Oslo"):
        done = ask(oai, messages=[{"role": "user", "content": f"Plan a stay in {city}."}],
                   tools=[tool], tool_choice="required", parallel_tool_calls=False,
                   max_tokens=96, temperature=0.9, seed=7)
        assert done.finish_reason == "tool_calls" and done.message.content is None
        assert set(json.loads(done.message.tool_calls[0].function.arguments)) == \
            {"city", "days"}


def test_strict_response_format_takes_exactly_the_listed_keys(oai) -> None:
    """Item 8, `response_format`: OpenAI's strict json_schema, without a word about keys."""
    shape = {"type": "json_schema", "json_schema": {"name": "stay", "schema": LOOSE,
                                                    "strict": True}}
    for city in ("Paris", "Kyoto", "Lima", "Oslo"):
        done = ask(oai, messages=[{"role": "user", "content": f"A stay in {city} as JSON."}],
                   response_format=shape, max_tokens=64, temperature=0.9, seed=7)
        assert done.finish_reason == "stop"
        assert set(json.loads(done.message.content)) == {"city", "days"}


@pytest.mark.parametrize("bad", [{**LOOSE, "additionalProperties": True},
                                 {**LOOSE, "required": ["city"]}],
                         ids=["extra-keys", "optional-key"])
def test_strict_schemas_that_contradict_openais_rules_are_refused_typed(oai, bad) -> None:
    tool = {"type": "function", "function": {"name": "plan", "parameters": bad,
                                             "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, messages=[{"role": "user", "content": "Hi"}], tools=[tool], max_tokens=4)
    assert (info.value.body["code"], info.value.body["param"]) == ("invalid_argument", "tools")
    assert "strict mode" in info.value.body["message"]


def test_parallel_tool_calls_false_keeps_one_call_under_auto(oai) -> None:
    """Item 9: the same greedy answer makes two calls, and one with parallel_tool_calls false."""
    free = ask(oai, messages=TWO_SUMS, tools=[ADD], tool_choice="auto", max_tokens=80)
    assert len(free.message.tool_calls or ()) == 2  # the premise: this prompt makes two
    one = ask(oai, messages=TWO_SUMS, tools=[ADD], tool_choice="auto", max_tokens=80,
              parallel_tool_calls=False)
    assert [c.function.arguments for c in one.message.tool_calls] == \
        [free.message.tool_calls[0].function.arguments]
    assert one.message.content is None and one.finish_reason == "tool_calls"


def ordinary_tools(count: int) -> list[dict]:
    """`count` tools of the size real agents send (~1.4 KB each: six parameters, each with a
    sentence or two of documentation)."""
    kinds = [{"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 0,
                                                    "maximum": 1000},
             {"enum": ["low", "medium", "high"]}, {"type": "boolean"}]
    tools = []
    for i in range(count):
        props = {f"field_{j}": {**kinds[(i + j) % 4], "description": (
            f"Parameter {j} of operation {i}: which records it selects, in which unit it is "
            "given, what happens when it is left out, and how it combines with the others.")}
            for j in range(6)}
        tools.append({"type": "function", "function": {
            "name": f"operation_{i}",
            "description": f"Operation {i} of the inventory service: looks records up.",
            "parameters": {"type": "object", "properties": props,
                           "required": sorted(props), "additionalProperties": False}}})
    return tools


def test_required_call_among_24_ordinary_tools_is_not_refused_as_a_grammar(oai) -> None:
    """Item 10: the tools' definitions (over the 32 KiB bound on a client's grammar) are
    bounded as tools, not as a grammar. Listed in the prompt they are ~10k tokens, past the
    default model's context, so here the request gets that refusal (tests/rest/
    test_tool_call_grammar_property.py forces a valid call among the same 24 tools)."""
    tools = ordinary_tools(24)
    assert len(json.dumps(tools)) > 33_000
    assert len(json.dumps([t["function"]["parameters"] for t in tools])) > 32_768
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, messages=[{"role": "user", "content": "Look up the records."}],
            tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=160)
    assert info.value.body["code"] == "context_length_exceeded", info.value.body


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_several_calls_leave_content_null(oai, choice) -> None:
    """Item 11: the newline between two calls is markup, not content."""
    done = ask(oai, messages=TWO_SUMS, tools=[ADD], tool_choice=choice, max_tokens=80)
    assert len(done.message.tool_calls) == 2
    assert done.message.content is None
    contents, calls, finish = streamed(oai, messages=TWO_SUMS, tools=[ADD], tool_choice=choice,
                                       max_tokens=80)
    assert contents == []
    assert [c["arguments"] for c in calls.values()] == \
        [c.function.arguments for c in done.message.tool_calls]
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_by_max_tokens_is_a_call_not_markup_in_content(oai, stream) -> None:
    """Item 8's last clause: a call cut short comes back as OpenAI returns one, a tool call
    with its arguments as far as they got and finish_reason "length"; no markup in content."""
    request = dict(messages=[{"role": "user", "content": "Book me a trip to Paris."}],
                   tools=[BOOK], tool_choice=named("book_trip"), max_tokens=24)
    if stream:
        contents, calls, finish = streamed(oai, **request)
        assert contents == [] and [c["name"] for c in calls.values()] == ["book_trip"]
        arguments = calls[0]["arguments"]
    else:
        done = ask(oai, **request)
        assert done.message.content is None
        assert [c.function.name for c in done.message.tool_calls] == ["book_trip"]
        arguments, finish = done.message.tool_calls[0].function.arguments, done.finish_reason
    assert finish == "length"
    assert arguments.startswith('{"city": ')
