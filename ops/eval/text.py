"""Evaluation text: real prose that ships with Python (offline), or any text file; and the
windows of token ids the comparison runs on."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SOURCE = "pydoc_data.topics"


def pydoc_topics_text() -> str:
    """Every entry of `pydoc_data.topics.topics` (the language reference's help texts), in
    sorted key order: the same text on every run of the same Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from). `None` means the pydoc topics."""
    if path is None:
        return pydoc_topics_text(), DEFAULT_SOURCE
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"text file {path!r} does not exist")
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {path!r} is empty")
    return text, str(file)


def make_windows(token_ids: list[int], window: int, max_windows: int) -> list[list[int]]:
    """Non-overlapping windows of exactly `window` tokens (a short tail is dropped). If there are
    more than `max_windows`, take that many evenly spaced across the text, so a capped run still
    samples all of it rather than only its beginning."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, got {max_windows}")
    count = len(token_ids) // window
    if count == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of "
                         f"{window}")
    picks = range(count) if count <= max_windows else (
        i * count // max_windows for i in range(max_windows))
    return [token_ids[i * window : (i + 1) * window] for i in picks]
