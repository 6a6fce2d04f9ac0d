"""The served OpenAPI document says what the server accepts. schemathesis generates requests
from it through its Python API (its pytest plugin breaks with pytest >= 9.1): valid ones
(positive mode) are served, or refused only for a reason the document says it cannot state;
invalid ones (negative mode) are refused with 400; none gets a 5xx or an undocumented status."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.rest.conftest import KEYS, MODEL, OPERATOR_KEY, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROUTES = {("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
          ("/ai/run/{model}", "post"), ("/status", "get"), ("/health", "get")}
GENERATION = ("/v1/chat/completions", "/v1/completions", "/ai/run/{model}")
MAX_TOKENS = 3  # generation is real: every generated request decodes a few tokens at most
U32 = 2**32 - 1
# What DESCRIPTION lists as refused for reasons the document cannot state, as (status, reason,
# param); the model is always the served one, so 403/404 do not arise here.
NOT_IN_THE_SCHEMA = {(400, "CONTEXT_LENGTH_EXCEEDED", None), (400, "INVALID_ARGUMENT", "prompt"),
                     (429, "TENANT_QUOTA_EXCEEDED", None),
                     *((400, "INVALID_ARGUMENT", param) for param in (
                         "response_format", "tools", "tool_choice", "structured_output"))}


def test_openapi_document_lists_exactly_the_api_routes(shim) -> None:
    doc = httpx.get(f"{shim.url}/openapi.json", timeout=30).json()
    served = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == ROUTES
    for path, method in ROUTES - {("/status", "get"), ("/health", "get")}:
        op = doc["paths"][path][method]
        assert op["security"] == [{"bearer": []}]
        assert "422" not in op["responses"] and {"400", "401", "429"} <= set(op["responses"])
    assert doc["paths"]["/status"]["get"]["security"] == [{"operator": []}]
    schemas = doc["components"]["schemas"]
    run_body = doc["paths"]["/ai/run/{model}"]["post"]["requestBody"]["content"]
    assert len(run_body["application/json"]["schema"]["oneOf"]) == 2
    for name in ("WorkersAIPrompt", "WorkersAIMessages"):
        assert schemas[name]["additionalProperties"] is False
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1


@pytest.fixture(scope="module")
def api_schema(shim: Shim) -> Any:
    return schemathesis.openapi.from_url(f"{shim.url}/openapi.json")


def _headers(path: str) -> dict[str, str]:
    key = OPERATOR_KEY if path == "/status" else KEYS["acme"]
    return {"authorization": f"Bearer {key}"}


def _integers(value: Any) -> Any:
    """2.0 as 2: to JSON Schema they are the same integer, to the server (strict, as
    DESCRIPTION says) only the first is."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _integers(v) for k, v in value.items()}
    return value


def _shorten(body: Any, mode: GenerationMode, path: str) -> None:
    """Short generations, each value kept as valid or invalid as it was: max_tokens capped; in
    positive mode, the served model (any string is valid, only one is served) and rules that
    DESCRIPTION states and a JSON schema cannot."""
    if not isinstance(body, dict):
        return
    if mode.is_positive:
        body.update(_integers(body))
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 0 <= value:
            body[key] = min(max(value, 1 if mode.is_positive else 0), MAX_TOKENS)
    if mode.is_positive:
        # both given must agree: a rule DESCRIPTION states, a JSON schema cannot
        body["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens",
                                                                          MAX_TOKENS))
        if path.startswith("/v1/"):
            body["model"] = MODEL
        # rules the schema cannot state: top_logprobs needs logprobs, min_tokens <= max_tokens,
        # a tool message answers a call; and few candidates and prompts (generation is real)
        if body.get("top_logprobs") is not None and path.endswith("/chat/completions"):
            body["logprobs"] = True
        if type(body.get("min_tokens")) is int:
            body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
        if type(body.get("n")) is int:
            body["n"] = min(body["n"], 2)
        if isinstance(body.get("prompt"), list) and body["prompt"] \
                and isinstance(body["prompt"][0], (str, list)):
            body["prompt"] = body["prompt"][:2]
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            if message.get("role") == "tool" and not message.get("tool_call_id"):
                message["tool_call_id"] = "call_0"
            if message.get("tool_calls") and message.get("role") != "assistant":
                message["role"] = "assistant"  # only the assistant makes calls


def _refusal(response: Any, path: str) -> tuple[int, str | None, str | None]:
    body = response.json()
    if path.startswith("/ai/"):
        return response.status_code, body["errors"][0]["reason"], None
    return response.status_code, body["error"]["reason"], body["error"]["param"]


def _exercise(api_schema: Any, mode: GenerationMode, max_examples: int,
              routes: set[tuple[str, str]]) -> Counter[tuple[str, int]]:
    seen: Counter[tuple[str, int]] = Counter()
    for path, method in sorted(routes):
        _exercise_one(api_schema[path][method.upper()], path, mode, max_examples, seen)
    return seen


def _exercise_one(operation: Any, path: str, mode: GenerationMode, max_examples: int,
                  seen: Counter[tuple[str, int]]) -> None:
    fixed: dict[str, Any] = {"headers": _headers(path)}  # only the request is generated
    if "{model}" in path:
        fixed["path_parameters"] = {"model": MODEL}

    @given(case=operation.as_strategy(generation_mode=mode, **fixed))
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def one(case: Any) -> None:
        _shorten(case.body, mode, path)
        response = case.call(timeout=120)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
        seen[(path, response.status_code)] += 1
        if mode.is_positive and response.status_code != 200:
            status, reason, param = _refusal(response, path)
            assert {(status, reason, param), (status, reason, None)} & NOT_IN_THE_SCHEMA, \
                (case.body, response.text)
        if mode.is_negative:
            assert response.status_code == 400, (case.body, response.text)

    one()


def test_valid_requests_are_served_or_refused_only_for_reasons_the_schema_cannot_state(
        api_schema) -> None:
    seen = _exercise(api_schema, GenerationMode.POSITIVE, 16, ROUTES)
    print(f"positive: {dict(seen)}")
    for path in GENERATION:
        assert seen[(path, 200)] > 0, f"no generated request to {path} reached generation"


def test_invalid_requests_are_refused_with_400(api_schema) -> None:
    generation = {(path, "post") for path in GENERATION}
    seen = _exercise(api_schema, GenerationMode.NEGATIVE, 12, generation)
    print(f"negative: {dict(seen)}")
    assert sum(seen.values()) >= 3 * 5
