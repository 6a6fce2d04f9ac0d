"""The one place where errors meet the wire: TesseraError <-> google.rpc.Status.

Every status carries exactly one ErrorInfo (domain `tessera`, the error's reason, its metadata)
and, for retryable reasons, a RetryInfo. The worker, the gateway and the SDK all use this module,
so a reason raised in a worker arrives at the SDK as the same exception class.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from runtime.errors import (
    ContextLengthExceeded,
    InvalidArgument,
    KVIntegrityViolation,
    ModelLoadError,
    ModelNotFound,
    RequestCancelled,
    TenantQuotaExceeded,
    TesseraError,
)

DOMAIN = "tessera"


class WorkerLost(TesseraError):
    reason = "WORKER_LOST"
    retryable = True

class WorkerStartFailed(TesseraError):
    """No worker of the model could start, several times in a row (the message gives the
    worker's last error line). Not retryable as such: the gateway keeps trying to start one,
    and serves again by itself once the cause (a missing module, a bad model path) is fixed."""

    reason = "WORKER_START_FAILED"


class Unavailable(TesseraError):
    """The server is shutting down (or not yet up): retry against another replica."""

    reason = "UNAVAILABLE"
    retryable = True

class Overloaded(TesseraError):
    reason = "OVERLOADED"
    retryable = True


class TenantConcurrencyExceeded(TesseraError):
    """The gateway's own per-tenant limit: the tenant already has as many requests in flight and
    waiting for this model as its key allows. Retry when one ends. Not the engine's
    TenantQuotaExceeded (a request that alone needs more KV than the tenant may hold: final)."""

    reason = "TENANT_CONCURRENCY_EXCEEDED"
    retryable = True


class DeadlineExceeded(TesseraError):
    reason = "DEADLINE_EXCEEDED"


class Unauthenticated(TesseraError):
    reason = "UNAUTHENTICATED"


class PermissionDenied(TesseraError):
    reason = "PERMISSION_DENIED"


class Internal(TesseraError):
    reason = "INTERNAL"


# reason -> (exception class, gRPC status code)
REASONS: dict[str, tuple[type[TesseraError], grpc.StatusCode]] = {
    "INVALID_ARGUMENT": (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    "CONTEXT_LENGTH_EXCEEDED": (ContextLengthExceeded, grpc.StatusCode.INVALID_ARGUMENT),
    "MODEL_NOT_FOUND": (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    "MODEL_LOAD_FAILED": (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    "UNAUTHENTICATED": (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    "PERMISSION_DENIED": (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    "OVERLOADED": (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "TENANT_QUOTA_EXCEEDED": (TenantQuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "TENANT_CONCURRENCY_EXCEEDED": (TenantConcurrencyExceeded,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED),
    "KV_INTEGRITY_VIOLATION": (KVIntegrityViolation, grpc.StatusCode.ABORTED),
    "WORKER_LOST": (WorkerLost, grpc.StatusCode.UNAVAILABLE),
    "WORKER_START_FAILED": (WorkerStartFailed, grpc.StatusCode.UNAVAILABLE),
    "UNAVAILABLE": (Unavailable, grpc.StatusCode.UNAVAILABLE),
    "DEADLINE_EXCEEDED": (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    "CANCELLED": (RequestCancelled, grpc.StatusCode.CANCELLED),
    "INTERNAL": (Internal, grpc.StatusCode.INTERNAL),
}

# What a status without ErrorInfo means (raised by gRPC itself, e.g. a dead socket). Our own
# OVERLOADED and TENANT_CONCURRENCY_EXCEEDED always carry ErrorInfo: a bare RESOURCE_EXHAUSTED
# is gRPC refusing a message or metadata over its size limits, which no retry can fix.
_BARE_CODES: dict[grpc.StatusCode, type[TesseraError]] = {
    grpc.StatusCode.UNAVAILABLE: WorkerLost,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: RequestCancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,
}

DEFAULT_RETRY_DELAY_S = 1.0


def _reason(exc: TesseraError) -> str:
    return exc.reason if exc.reason in REASONS else "INTERNAL"


def retry_delay_s(exc: TesseraError) -> float | None:
    """How long a client should wait before retrying, or None when retrying does not help."""
    if not exc.retryable:
        return None
    return float(exc.metadata.get("retry_after_s", DEFAULT_RETRY_DELAY_S))


def to_status(exc: BaseException) -> grpc.Status:
    """The rich status for any exception; non-tessera exceptions become INTERNAL, unexplained."""
    if not isinstance(exc, TesseraError):
        exc = Internal(f"internal error: {type(exc).__name__}")
    reason = _reason(exc)
    code = REASONS[reason][1]
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=exc.metadata)
    details = [info]
    delay = retry_delay_s(exc)
    if delay is not None:
        retry = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=int(delay),
                                              nanos=int((delay % 1) * 1e9)))
        details.append(retry)
    status = status_pb2.Status(code=code.value[0], message=exc.message)
    for detail in details:
        status.details.add().Pack(detail)
    return rpc_status.to_status(status)


def from_rpc_error(err: grpc.RpcError) -> TesseraError:
    """The typed error a failed call carries (its ErrorInfo), or one inferred from its code."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    message = err.details() or ""  # type: ignore[attr-defined]
    if status is not None:
        info, retry = _unpack(status)
        if info is not None and info.domain == DOMAIN and info.reason in REASONS:
            error = REASONS[info.reason][0](status.message or message, **dict(info.metadata))
            if retry is not None:
                delay = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
                error.metadata["retry_after_s"] = f"{delay:g}"
            return error
    code = err.code()  # type: ignore[attr-defined]
    cls = _BARE_CODES.get(code, Internal)
    return cls(message or f"gRPC {code.name}", grpc_code=code.name)


def _unpack(status: Any) -> tuple[Any, Any]:
    info = retry = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
    return info, retry


def error_class(reason: str) -> type[TesseraError]:
    return REASONS.get(reason, (Internal, None))[0]

