"""The served OpenAPI document is true to the routes, and schemathesis, generating requests from
it (valid and invalid), finds no 5xx and no undocumented status."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.rest.conftest import KEYS, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROUTES = {("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
          ("/ai/run/{model}", "post"), ("/status", "get")}
MAX_TOKENS = 3  # generation is real: keep every generated request short


def test_openapi_document_lists_exactly_the_api_routes(shim) -> None:
    doc = httpx.get(f"{shim.url}/openapi.json", timeout=30).json()
    served = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == ROUTES
    for path, method in ROUTES - {("/status", "get")}:
        op = doc["paths"][path][method]
        assert op["security"] == [{"bearer": []}]
        assert "422" not in op["responses"] and {"400", "401", "429"} <= set(op["responses"])
    assert doc["components"]["schemas"]["WorkersAIRequest"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def api_schema(shim: Shim) -> Any:
    return schemathesis.openapi.from_url(f"{shim.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(body: Any) -> None:
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = min(max(body[key], 0), MAX_TOKENS)
        if "max_completion_tokens" not in body:
            body.setdefault("max_tokens", MAX_TOKENS)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_no_server_error(case) -> None:
    _bounded(case.body)
    case.call_and_validate(headers={"authorization": f"Bearer {KEYS['acme']}"},
                           checks=[not_a_server_error, status_code_conformance], timeout=60)
