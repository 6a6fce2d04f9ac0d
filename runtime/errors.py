"""Typed errors. Every failure a client can see is one of these, named by an UPPER_SNAKE reason."""

from __future__ import annotations

from typing import Any, ClassVar

# NOTE: errors travel in gRPC trailers (8 KiB by default): a message or metadata value built
# from client input is cut here, so an error's class never depends on the input's size.
MAX_MESSAGE_CHARS = 1024
MAX_METADATA_CHARS = 128


def bounded(text: str, limit: int) -> str:
    """text, cut to at most `limit` characters (marked with an ellipsis when cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


class TesseraError(Exception):
    """Base class: `reason` is the stable machine-readable name; `metadata` is safe to show."""

    reason: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **metadata: Any) -> None:
        message = bounded(str(message), MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.metadata = {k: bounded(str(v), MAX_METADATA_CHARS) for k, v in metadata.items()}

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


class TenantQuotaExceeded(TesseraError):
    """Raised for a request that alone needs more KV than its tenant may hold: never retryable.
    (Within the quota, a tenant's requests wait instead.)"""

    reason = "TENANT_QUOTA_EXCEEDED"


class KVIntegrityViolation(TesseraError):
    reason = "KV_INTEGRITY_VIOLATION"


class KVPoolExhausted(TesseraError):
    """No room for a request's KV right now (a KV import's reservation): retry later."""

    reason = "OVERLOADED"
    retryable = True


class TransferDeadlineExceeded(TesseraError):
    """A KV transfer between workers stalled past its deadline."""

    reason = "DEADLINE_EXCEEDED"


class RequestCancelled(TesseraError):
    reason = "CANCELLED"
