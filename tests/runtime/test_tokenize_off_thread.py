"""Tokenizing a long prompt in a pool thread leaves other Python threads (the engine's step
loop) running: the tokenizer releases the GIL while it works."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.loader import open_checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    return open_checkpoint(None).tokenizer


def _longest_stall_s(work) -> tuple[float, float]:
    """(longest gap of a 1 ms ticker thread while `work` runs in another thread, work's s)."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    elapsed = time.perf_counter() - started
    done.set()
    ticker.join()
    return max(gaps), elapsed


@pytest.mark.parametrize("chat", [False, True])
def test_a_megabyte_prompt_does_not_hold_the_gil_while_it_is_tokenized(tokenizer, chat) -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 24000)[: 1 << 20]
    if chat:
        stall, elapsed = _longest_stall_s(
            lambda: tokenizer.encode_chat([{"role": "user", "content": text}]))
    else:
        stall, elapsed = _longest_stall_s(lambda: tokenizer.encode(text))
    # Holding the GIL would stall the ticker for the whole encode (~0.6-3 s here).
    assert stall < 0.5 * elapsed, (stall, elapsed)
