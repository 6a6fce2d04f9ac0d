"""The one exception <-> status mapping: one ErrorInfo per status, RetryInfo only where
retrying helps, the gRPC code per reason; the SDK's retry policy follows it."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gateway.errors import DOMAIN, REASONS, Overloaded, WorkerLost, to_status
from gateway.stream import RetryPolicy
from runtime.errors import InvalidArgument

EXPECTED_CODES = {
    "KV_INTEGRITY_VIOLATION": grpc.StatusCode.ABORTED,
    "OVERLOADED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TENANT_CONCURRENCY_EXCEEDED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "WORKER_LOST": grpc.StatusCode.UNAVAILABLE,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "MODEL_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
}


def details_of(status: grpc.Status) -> list:
    raw = dict(status.trailing_metadata)["grpc-status-details-bin"]
    return list(status_pb2.Status.FromString(raw).details)


@pytest.mark.parametrize("reason", sorted(REASONS))
def test_each_reason_has_one_error_info_and_retry_info_only_if_retryable(reason: str) -> None:
    cls, code = REASONS[reason]
    status = to_status(cls("boom", field="x"))
    assert status.code == code
    assert reason not in EXPECTED_CODES or code == EXPECTED_CODES[reason]
    details = details_of(status)
    infos = [d for d in details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    retries = [d for d in details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    assert len(infos) == 1 and len(retries) == (1 if cls.retryable else 0)
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert (info.domain, info.reason, dict(info.metadata)) == (DOMAIN, reason, {"field": "x"})


def test_a_plain_exception_becomes_internal_without_its_message() -> None:
    status = to_status(RuntimeError("secret path /etc/x"))
    assert status.code == grpc.StatusCode.INTERNAL and "secret" not in status.details


def test_retry_policy_retries_only_retryable_reasons_within_attempts_and_budget() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0, budget_s=1.5)
    assert policy.delay(InvalidArgument("bad"), 0, 0.0) is None
    assert policy.delay(Overloaded("busy", retry_after_s=0.5), 0, 0.0) == 0.5
    assert policy.delay(WorkerLost("gone"), 1, 0.0) == 1.0  # the default hint, capped
    assert policy.delay(WorkerLost("gone"), 2, 0.0) is None  # out of attempts
    assert policy.delay(Overloaded("busy", retry_after_s=1), 0, 1.0) is None  # out of budget
