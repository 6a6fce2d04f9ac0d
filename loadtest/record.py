"""One streamed call as locust entries: the call itself (request_type the transport, failures
by reason), and its streaming metrics as extra entries under the same name, so they land in
locust's stats and CSV: TTFT and ITL in milliseconds, TOKENS and CACHED as counts (read the
"response time" columns of those rows as numbers of tokens)."""

from __future__ import annotations

import time
from typing import Any

TTFT, ITL, TOKENS, CACHED = "TTFT", "ITL", "TOKENS", "CACHED"


class CallRecord:
    def __init__(self, events: Any, request_type: str, name: str) -> None:
        self.events, self.request_type, self.name = events, request_type, name
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps_ms: list[float] = []
        self.text = ""

    def chunk(self, text: str) -> None:
        """A streamed piece of the reply arrived (one or more tokens)."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps_ms.append((now - self.last) * 1000)
        self.last = now
        self.text += text

    def succeeded(self, completion_tokens: int, cached_tokens: int) -> None:
        self._fire(self.request_type, self._elapsed_ms(), completion_tokens)
        if self.first is not None:
            self._fire(TTFT, (self.first - self.start) * 1000)
        for gap in self.gaps_ms:
            self._fire(ITL, gap)
        self._fire(TOKENS, completion_tokens, completion_tokens)
        self._fire(CACHED, cached_tokens)

    def failed(self, reason: str) -> None:
        """`reason`: the typed error's UPPER_SNAKE reason, so failures group by it."""
        self._fire(self.request_type, self._elapsed_ms(), 0, exception=reason)

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def _fire(self, request_type: str, value: float, length: int = 0,
              exception: str | None = None) -> None:
        self.events.request.fire(request_type=request_type, name=self.name, response_time=value,
                                 response_length=length, exception=exception, context={})
