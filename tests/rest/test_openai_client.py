"""The official `openai` package, used as a user would, against the shim over loopback."""

from __future__ import annotations

import uuid

import openai
import pytest

from gateway.client import NO_RETRY, Client
from tests.rest.conftest import KEYS, MODEL, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LONG_PROMPT = ("You are a careful assistant. Answer in one short sentence, with no preamble "
               "and no list. The question is about geography and history, and it is asked by "
               "a student: which river flows through the city of Paris, and where does it end?")


def make_client(shim: Shim, tenant: str = "acme", key: str | None = None,
                **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim.url}/v1", api_key=key or KEYS[tenant],
                         max_retries=0, timeout=120, default_headers=headers or None)


@pytest.fixture(scope="module")
def oai(shim: Shim) -> openai.OpenAI:
    return make_client(shim)


def sdk_text(shim: Shim, prompt: str, max_tokens: int) -> str:
    with Client(shim.runner.target, api_key=KEYS["acme"], retry=NO_RETRY) as c:
        return "".join(ch.text for ch in c.generate(prompt, model=MODEL, max_tokens=max_tokens,
                                                   temperature=0.0, ignore_eos=True))


def test_completion_equals_the_grpc_sdk_and_names_the_served_configuration(shim, oai) -> None:
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    done = raw.parse()
    assert done.choices[0].text == sdk_text(shim, "The capital of France is", 6)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 6
    assert done.usage.total_tokens == done.usage.prompt_tokens + 6
    served = raw.headers["x-tessera-served"]
    assert "revision=" in served and "prefill=" in served and "decode=" in served
    assert done.system_fingerprint and done.model == MODEL


def test_chat_completion_answers_as_the_assistant(oai) -> None:
    done = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8,
        temperature=0)
    msg = done.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    assert done.usage.prompt_tokens > 5 and 0 < done.usage.completion_tokens <= 8


def test_streamed_chat_equals_the_unstreamed_one_and_ends_with_usage(oai) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                  max_tokens=8, temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oai.chat.completions.create(**kwargs, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_without_usage_option_has_no_usage_chunk(oai) -> None:
    chunks = list(oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                         temperature=0, stream=True))
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_second_request_of_a_session_reports_cached_tokens(shim) -> None:
    client = make_client(shim, **{"x-session-affinity": uuid.uuid4().hex})
    first, second = (client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2,
                                               temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens == first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_models_list_names_the_served_model(oai) -> None:
    assert MODEL in [m.id for m in oai.models.list()]


def test_unknown_key_raises_authentication_error(shim) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        make_client(shim, key="not-a-key").models.list()
    assert info.value.code == "invalid_api_key"


def test_model_outside_the_tenants_list_raises_permission_denied(shim) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        make_client(shim, "other").completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def test_unknown_model_raises_not_found(oai) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="@cf/no/such-model", prompt="Hi", max_tokens=2)
    assert info.value.code == "model_not_found"


def test_bad_sampling_value_raises_bad_request_naming_the_field(oai) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-1)
    assert info.value.param == "temperature"


def test_too_long_prompt_raises_bad_request_context_length_exceeded(oai) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=[100] * 1500, max_tokens=2)
    assert info.value.code == "context_length_exceeded"


def test_request_over_the_tenant_quota_is_429_not_to_be_retried(oai) -> None:
    with pytest.raises(openai.RateLimitError) as info:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=1200)
    assert info.value.code == "insufficient_quota"
    assert info.value.response.headers["x-should-retry"] == "false"


def test_corrupted_page_raises_conflict(shim) -> None:
    client = make_client(shim, "drill")
    prompt = "Tell me a long story about a dragon who guards a library of old books. " * 2
    with pytest.raises(openai.ConflictError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=64,
                                  extra_body={"ignore_eos": True})
    assert info.value.code == "kv_integrity_violation"


def test_full_pool_raises_rate_limit_with_retry_after(shim, oai) -> None:
    with shim.only_slot_taken(max_queue=0):
        with pytest.raises(openai.RateLimitError) as info:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.code == "overloaded"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_every_chunk_of_a_stream_names_the_model_as_models_list_does(oai) -> None:
    listed = [m.id for m in oai.models.list().data]
    chunks = list(oai.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, stream=True))
    assert len(chunks) >= 3
    assert {c.model for c in chunks} == {MODEL} and listed == [MODEL]
