"""A pool whose workers cannot start: consecutive failed starts are counted, and past the
limit the pool is failed with the cause (the worker's last error line on stderr) so requests
get WORKER_START_FAILED at once instead of waiting out a start timeout; the first worker that
becomes ready clears it. The supervisor keeps retrying on its back-off meanwhile."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import deque
from collections.abc import Iterable

from gateway import metrics
from gateway.errors import WorkerStartFailed

# A traceback's last line: "ModuleNotFoundError: No module named 'msgpack'"
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def error_line(lines: Iterable[str]) -> str | None:
    """The last error a worker wrote to stderr: an exception's line, or an error-level JSON log
    record's `reason: error`; None when there is neither."""
    for line in reversed([ln.strip() for ln in lines if ln.strip()]):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                why = record.get("error") or record.get("event")
                return f"{record['reason']}: {why}" if record.get("reason") else str(why)
        elif _EXCEPTION_LINE.match(line):
            return line
    return None


class StderrTail:
    """Relays a worker's stderr to the gateway's, keeping its last lines for error_line."""

    def __init__(self, keep_lines: int = 64) -> None:
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self.task: asyncio.Task[None] | None = None

    def follow(self, stream: asyncio.StreamReader | None) -> None:
        if stream is not None:
            self.task = asyncio.create_task(self._relay(stream))

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        # NOTE: reads to the end whatever happens to the writes: a pipe nobody drains would
        # block the worker on its next log line.
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line past the reader's limit: what is buffered of it
                line = await stream.read(1 << 16)
            if not line:
                return
            text = line.decode(errors="replace")
            self.lines.append(text)
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):  # the gateway's stderr closed: keep draining
                pass

    async def error_line(self, wait_s: float = 2.0) -> str | None:
        """error_line of what it read; waits up to wait_s for the rest of an exited worker's
        output first."""
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=wait_s)
        return error_line(self.lines)


class StartFailures:
    """Consecutive failed worker starts of one pool; failed once `limit` of them happened."""

    def __init__(self, pool_label: str, limit: int) -> None:
        self.pool_label = pool_label
        self.limit = limit
        self.consecutive = 0
        self.cause: str | None = None

    @property
    def failed(self) -> bool:
        return self.consecutive >= self.limit

    def record_failure(self, cause: str) -> bool:
        """Count one failed start; True when this one fails the pool."""
        self.consecutive += 1
        self.cause = cause
        metrics.WORKER_START_FAILURES.labels(self.pool_label).inc()
        if self.consecutive == self.limit:
            metrics.POOL_START_FAILED.labels(self.pool_label).set(1)
            return True
        return False

    def record_ready(self) -> None:
        self.consecutive = 0
        self.cause = None
        metrics.POOL_START_FAILED.labels(self.pool_label).set(0)

    def error(self) -> WorkerStartFailed:
        return WorkerStartFailed(
            f"no worker of {self.pool_label!r} could start ({self.consecutive} tries in a row; "
            f"still retrying): {self.cause}", model=self.pool_label)
