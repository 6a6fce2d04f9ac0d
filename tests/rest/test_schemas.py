"""The request schemas state the engine's own bounds: every edge the OpenAPI document gives a
sampling field is accepted by SamplingParams after the wire (float32, int32, uint64), and the
stop list is bounded as the engine bounds it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from gateway.rest.schemas import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    Sampling,
    WorkersAIPrompt,
    WorkersAIRun,
)
from gateway.wire import sampling_options, sampling_params

# NOTE: max_tokens is left out: its minimum (0 here, 1 in the engine) is the text branch's.
MESSAGE = {"role": "user", "content": "Hi"}
RANGED = [name for name in Sampling.model_fields if name not in ("max_tokens", "stop",
                                                                   "ignore_eos")]


def _bounds(name: str) -> list[Any]:
    schema = Sampling.model_json_schema()["properties"][name]
    (ranged,) = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    return [ranged[key] for key in ("minimum", "maximum") if key in ranged]


def _through_the_wire(body: Sampling) -> Any:
    return sampling_params(sampling_options(**body.sampling()))


@pytest.mark.parametrize("name", RANGED)
def test_each_bound_the_document_states_is_accepted_by_the_engine(name: str) -> None:
    bounds = _bounds(name)
    assert len(bounds) == 2, f"{name} has no range in the document"
    for value in bounds:
        _through_the_wire(Sampling.model_validate({name: value}))


@pytest.mark.parametrize(("name", "outside"), [("temperature", -1e-9), ("top_p", 0.0),
                                               ("top_p", 1.0000001), ("top_k", -2),
                                               ("repetition_penalty", 0.0),
                                               ("presence_penalty", 2.0001),
                                               ("temperature", 3.5e38)])
def test_a_value_outside_a_bound_is_refused_before_the_wire(name: str, outside: Any) -> None:
    with pytest.raises(ValidationError):
        Sampling.model_validate({name: outside})


def test_top_k_zero_means_off_as_minus_one() -> None:
    assert _through_the_wire(Sampling(top_k=0)).top_k == -1


def test_stop_list_is_bounded_as_the_engine_bounds_it() -> None:
    longest = ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert _through_the_wire(Sampling(stop=longest)).stop == tuple(longest)
    for stop in ([*longest, "s"], ["s" * (MAX_STOP_CHARS + 1)], [""], ""):
        with pytest.raises(ValidationError):
            Sampling.model_validate({"stop": stop})


def test_a_run_needs_exactly_one_non_empty_prompt_or_conversation() -> None:
    run = TypeAdapter(WorkersAIRun)
    assert isinstance(run.validate_python({"prompt": "Hi"}), WorkersAIPrompt)
    for body in ({}, {"prompt": ""}, {"messages": []}, {"prompt": "Hi", "messages": [MESSAGE]}):
        with pytest.raises(ValidationError):
            run.validate_python(body)


def test_a_chat_needs_a_message() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
