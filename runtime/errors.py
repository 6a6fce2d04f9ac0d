"""Typed errors. Every failure a client can see is one of these, named by an UPPER_SNAKE reason."""

from __future__ import annotations

from typing import Any, ClassVar


class TesseraError(Exception):
    """Base class: `reason` is the stable machine-readable name; `metadata` is safe to show."""

    reason: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **metadata: Any) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason}: {self.message})"


class InvalidArgument(TesseraError, ValueError):
    reason = "INVALID_ARGUMENT"


class ContextLengthExceeded(InvalidArgument):
    reason = "CONTEXT_LENGTH_EXCEEDED"


class ModelNotFound(TesseraError, FileNotFoundError):
    reason = "MODEL_NOT_FOUND"


class ModelLoadError(TesseraError):
    """The checkpoint exists but cannot be read: corrupt, truncated, or inconsistent."""

    reason = "MODEL_LOAD_FAILED"


class Overloaded(TesseraError):
    reason = "OVERLOADED"
    retryable = True


class TenantQuotaExceeded(TesseraError):
    """Raised for a request that alone needs more KV than its tenant may hold: never retryable.
    (Within the quota, a tenant's requests wait instead.)"""

    reason = "TENANT_QUOTA_EXCEEDED"


class KVIntegrityViolation(TesseraError):
    reason = "KV_INTEGRITY_VIOLATION"


class RequestCancelled(TesseraError):
    reason = "CANCELLED"


class DeadlineExceeded(TesseraError):
    reason = "DEADLINE_EXCEEDED"


class WorkerLost(TesseraError):
    reason = "WORKER_LOST"
    retryable = True
