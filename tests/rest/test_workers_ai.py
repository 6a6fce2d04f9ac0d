"""Workers-AI-style calls with raw HTTP (httpx, as curl would send them): envelope, SSE, errors."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.rest.conftest import MODEL, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run(shim: Shim, body: dict, model: str = MODEL, tenant: str = "acme") -> httpx.Response:
    return httpx.post(f"{shim.url}/ai/run/{model}", json=body, headers=shim.headers(tenant),
                      timeout=120)


def sse_data(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


def test_prompt_answers_in_the_success_envelope_with_usage(shim) -> None:
    r = run(shim, {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    result = body["result"]
    assert result["response"]
    assert result["usage"]["completion_tokens"] <= 5
    assert result["usage"]["total_tokens"] == (result["usage"]["prompt_tokens"]
                                               + result["usage"]["completion_tokens"])
    assert "decode=" in r.headers["x-tessera-served"]


def test_messages_are_rendered_with_the_chat_template(shim) -> None:
    r = run(shim, {"messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Say hi."}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["result"]["response"]
    assert r.json()["result"]["usage"]["prompt_tokens"] > 10


def test_stream_is_server_sent_events_ending_with_usage_and_done(shim) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True,
            "ignore_eos": True}
    r = run(shim, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert len(parsed) > 2 and all("response" in p for p in parsed)
    assert parsed[-1]["usage"]["completion_tokens"] == 6
    whole = run(shim, {**body, "stream": False}).json()["result"]["response"]
    assert "".join(p["response"] for p in parsed) == whole


def test_unknown_model_is_404_in_the_failure_envelope(shim) -> None:
    r = run(shim, {"prompt": "Hi"}, model="@cf/meta/not-served-here")
    assert r.status_code == 404
    body = r.json()
    assert body["success"] is False and body["result"] is None
    assert body["errors"][0]["reason"] == "MODEL_NOT_FOUND"
    assert body["errors"][0]["code"] == 5007 and "@cf/meta/not-served-here" in \
        body["errors"][0]["message"]


def test_missing_auth_is_401_in_the_failure_envelope(shim) -> None:
    r = httpx.post(f"{shim.url}/ai/run/{MODEL}", json={"prompt": "Hi"}, timeout=30)
    assert r.status_code == 401
    assert r.json()["success"] is False
    assert r.json()["errors"][0]["reason"] == "UNAUTHENTICATED"


def test_prompt_and_messages_together_are_refused(shim) -> None:
    r = run(shim, {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400
    assert "exactly one" in r.json()["errors"][0]["message"]


def test_integrity_abort_mid_stream_arrives_as_an_error_event(shim) -> None:
    prompt = "Tell me a long story about a dragon who guards a library of old books. " * 2
    r = run(shim, {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True},
            tenant="drill")
    if r.status_code == 409:  # aborted before the first token: a status of its own
        assert r.json()["errors"][0]["reason"] == "KV_INTEGRITY_VIOLATION"
        return
    last = json.loads(sse_data(r.text)[-1])
    assert last["success"] is False
    assert last["errors"][0]["reason"] == "KV_INTEGRITY_VIOLATION"


def test_curl_style_body_without_json_content_type_is_read_as_json(shim) -> None:
    r = httpx.post(f"{shim.url}/ai/run/{MODEL}", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers={**shim.headers(),
                            "content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["success"] is True


def test_prompt_gets_the_chat_template_unless_raw(shim) -> None:
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    templated = run(shim, {"prompt": "Say hi.", **base}).json()["result"]
    as_messages = run(shim, {"messages": [{"role": "user", "content": "Say hi."}],
                             **base}).json()["result"]
    raw = run(shim, {"prompt": "Say hi.", "raw": True, **base}).json()["result"]
    assert templated["response"] == as_messages["response"]
    assert templated["usage"]["prompt_tokens"] == as_messages["usage"]["prompt_tokens"]
    assert raw["usage"]["prompt_tokens"] < templated["usage"]["prompt_tokens"]
    completion = httpx.post(f"{shim.url}/v1/completions", headers=shim.headers(), timeout=60,
                            json={"model": MODEL, "prompt": "Say hi.", **base}).json()
    assert raw["response"] == completion["choices"][0]["text"]
