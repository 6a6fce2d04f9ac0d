"""Progress a person can see on long work (model load, native builds, convert, calibration): a
tqdm bar when stderr is a terminal, otherwise logfmt lines on the `tessera.progress` logger
(`progress task=... done=... total=... elapsed_s=... eta_s=...`) at most every `every_s`
seconds, plus one at the start and one at the end.

Where nothing has configured logging (a bare `tessera convert` piped to a file), the lines go
to stderr themselves, so a non-terminal run is never silent.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger("tessera.progress")
T = TypeVar("T")
EVERY_S = 5.0


def _on_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Work done on one task: `update(n)` as it goes, `close()` at the end (or use `with`).
    `total` None means unknown (a count and a rate, no ETA)."""

    def __init__(self, task: str, total: int | None = None, unit: str = "it",
                 every_s: float = EVERY_S) -> None:
        self.task, self.total, self.unit, self.every_s = task, total, unit, every_s
        self.done = 0
        self.started = time.monotonic()
        self._last_line = self.started
        self._closed = False
        self._bar: Any = None
        if _on_terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=task, unit=f" {unit}", leave=False,
                             dynamic_ncols=True)
        else:
            self._line("start")

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif time.monotonic() - self._last_line >= self.every_s:
            self._line("running")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            print(f"{self.task}: {self.done} {self.unit} in "
                  f"{time.monotonic() - self.started:.1f} s", file=sys.stderr, flush=True)
        else:
            self._line("done")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, state: str) -> None:
        now = time.monotonic()
        self._last_line = now
        elapsed = now - self.started
        fields: dict[str, Any] = {"task": self.task, "state": state, "done": self.done,
                                  "total": self.total, "unit": self.unit,
                                  "elapsed_s": round(elapsed, 1)}
        if self.total and 0 < self.done < self.total:
            fields["eta_s"] = round(elapsed * (self.total - self.done) / self.done, 1)
        text = "progress " + " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        if log.hasHandlers():
            log.info(text, extra={"progress": fields})
        else:
            print(text, file=sys.stderr, flush=True)


def _logfmt(value: Any) -> str:
    text = "-" if value is None else str(value)
    return f'"{text}"' if " " in text else text


def progress(items: Iterable[T], task: str, total: int | None = None,
             unit: str = "it") -> Iterator[T]:
    """`items`, counted as they are consumed (`total` defaults to len(items) where it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(task, total, unit) as p:
        for item in items:
            yield item
            p.update()


@contextmanager
def waiting(task: str, every_s: float = EVERY_S) -> Iterator[None]:
    """For one long call that reports nothing itself (a C++ build): elapsed time shown while
    it runs, a line at the start and the end."""
    p = Progress(task, None, "s", every_s)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(min(1.0, every_s)):
            p.update(0)
            if p._bar is not None:
                p._bar.refresh()

    ticker = threading.Thread(target=tick, name="tessera-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        p.done = round(time.monotonic() - p.started)
        p.close()
