"""Every gateway reason has an HTTP status, an OpenAI type/code and a Workers-AI code."""

from __future__ import annotations

import json

import pytest

from gateway.errors import REASONS, Overloaded, TenantConcurrencyExceeded
from gateway.rest.errors import HTTP_ERRORS, error_response
from runtime.errors import TenantQuotaExceeded, TesseraError

EXPECTED = {"INVALID_ARGUMENT": 400, "CONTEXT_LENGTH_EXCEEDED": 400, "UNAUTHENTICATED": 401,
            "PERMISSION_DENIED": 403, "MODEL_NOT_FOUND": 404, "KV_INTEGRITY_VIOLATION": 409,
            "OVERLOADED": 429, "TENANT_QUOTA_EXCEEDED": 429, "TENANT_CONCURRENCY_EXCEEDED": 429,
            "WORKER_LOST": 503,
            "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}


def test_every_gateway_reason_has_an_http_mapping() -> None:
    assert set(REASONS) <= set(HTTP_ERRORS)
    assert len({e.workers_ai_code for e in HTTP_ERRORS.values()}) == len(HTTP_ERRORS)


@pytest.mark.parametrize(("reason", "status"), sorted(EXPECTED.items()))
def test_reason_maps_to_its_status_in_both_envelopes(reason: str, status: int) -> None:
    error = REASONS[reason][0]("boom")
    for workers_ai in (False, True):
        response = error_response(error, workers_ai)
        assert response.status_code == status
        body = json.loads(bytes(response.body))
        found = body["errors"][0]["reason"] if workers_ai else body["error"]["reason"]
        assert found == reason


def test_retryable_reason_carries_retry_after_rounded_up() -> None:
    response = error_response(Overloaded("busy", retry_after_s="0.2"), workers_ai=False)
    assert response.headers["retry-after"] == "1"


def test_tenant_concurrency_429_says_when_to_retry_unlike_the_kv_quota_429() -> None:
    response = error_response(TenantConcurrencyExceeded("busy key", retry_after_s=2),
                              workers_ai=True)
    assert response.status_code == 429
    assert (response.headers["retry-after"], response.headers["x-should-retry"]) == ("2", "true")


def test_non_retryable_429_says_do_not_retry() -> None:
    response = error_response(TenantQuotaExceeded("too big"), workers_ai=False)
    assert "retry-after" not in response.headers
    assert response.headers["x-should-retry"] == "false"


def test_unknown_reason_is_a_500() -> None:
    class Odd(TesseraError):
        reason = "SOMETHING_NEW"

    assert error_response(Odd("?"), workers_ai=False).status_code == 500
