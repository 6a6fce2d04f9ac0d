"""structlog JSON logs, one object per line on stderr; callers bind request id, tenant, worker.
Standard-library log records (the engine's) are rendered as the same JSON."""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING


def _import_structlog() -> ModuleType:
    # NOTE: structlog.dev imports rich when it is installed (~50 ms of CPU in every gateway,
    # template and worker start) for its console renderer's tracebacks, which these JSON logs
    # never use; rich stays importable for anyone else.
    if "rich" in sys.modules:
        import structlog
    else:
        sys.modules["rich"] = None  # type: ignore[assignment]  # NOTE: "no such module"
        try:
            import structlog
        finally:
            del sys.modules["rich"]
    return structlog


if TYPE_CHECKING:
    import structlog
else:
    structlog = _import_structlog()

_configured = False


class _Stderr:
    """Whatever sys.stderr is at write time (test capture, a redirect), not at configure time."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "INFO") -> None:
    global _configured
    if _configured:
        return
    _configured = True
    shared: list = [structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True)]
    handler = logging.StreamHandler(_Stderr())  # type: ignore[arg-type]
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer()],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared]))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
