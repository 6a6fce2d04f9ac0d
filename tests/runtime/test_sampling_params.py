"""SamplingParams on their own: what is accepted as vLLM's users send it, what is refused, and
that a refusal never echoes client input whose size the client chose."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidArgument
from runtime.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_both_mean_off(top_k):
    assert SamplingParams(top_k=top_k).top_k == -1


def test_max_tokens_defaults_to_16_offline_and_may_be_left_unset():
    assert SamplingParams().max_tokens == 16
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_stop_strings_up_to_the_caps_are_accepted():
    params = SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    assert len(params.stop) == MAX_STOP_STRINGS


@pytest.mark.parametrize("stop", [["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)]],
                         ids=["too_many", "too_long"])
def test_stop_past_the_caps_is_invalid_and_says_the_cap(stop):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(stop=stop)
    assert info.value.metadata["field"] == "stop"
    assert str(MAX_STOP_STRINGS if len(stop) > 1 else MAX_STOP_CHARS) in info.value.message
    assert "xx" not in info.value.message


def test_an_empty_stop_string_next_to_a_long_one_gets_one_error_whatever_the_length():
    errors = set()
    for n in (3_000, 6_000, 50_000):
        with pytest.raises(InvalidArgument) as info:
            SamplingParams(stop=["", "x" * n])
        errors.add((info.value.reason, info.value.message, tuple(info.value.metadata.items())))
    assert len(errors) == 1
    (reason, message, _), = errors
    assert reason == "INVALID_ARGUMENT" and "non-empty" in message and "xx" not in message


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot" * 1000),
    ("seed", "4" * 1000),
    ("seed", 10**400),
    ("stop", ["y" * 1000, 3]),
    ("stop_token_ids", [-1] * 1000),
], ids=["str_temperature", "str_seed", "huge_seed", "stop_list", "stop_token_ids_list"])
def test_messages_echo_numbers_never_strings_or_lists(field, value):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**{field: value})
    assert len(info.value.message) < 120
    assert "hot" not in info.value.message and "444" not in info.value.message
    assert "yyy" not in info.value.message and "-1, -1" not in info.value.message


def test_messages_still_echo_a_bad_number():
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(top_p=1.5)
    assert "got 1.5" in info.value.message
