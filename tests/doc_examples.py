"""The runnable examples of README.md and docs/*.md, as docs/examples.md defines them.

A fenced block whose info string is `sh example` or `python example` is runnable; the fenced
block right after it, when its info string is `output`, is what it prints, where `...` stands
for any text (doctest's ELLIPSIS). Torch-free: tests/test_docs_examples.py runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LANGUAGES = ("sh", "python")
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    info: str
    body: str
    line: int


@dataclass(frozen=True)
class Example:
    """One runnable block: `where` is `path:line` of its fence, `expected` its output block's
    text (None when the page shows none)."""

    where: str
    language: str
    code: str
    expected: str | None


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[Block]:
    return [Block(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def examples_in(path: Path) -> list[Example]:
    """The page's runnable examples, in page order. ValueError for an `example` block in a
    language that is not run, or an `output` block that follows no example."""
    blocks = fenced_blocks(path.read_text())
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []
    for i, block in enumerate(blocks):
        words = block.info.split()
        if words == ["output"] and (i == 0 or "example" not in blocks[i - 1].info.split()):
            raise ValueError(f"{where}:{block.line}: an output block must follow an example")
        if "example" not in words:
            continue
        if len(words) != 2 or words[0] not in LANGUAGES:
            raise ValueError(f"{where}:{block.line}: runnable blocks are "
                             f"'sh example' or 'python example', not {block.info!r}")
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        expected = after.body if after is not None and after.info == "output" else None
        found.append(Example(f"{where}:{block.line}", words[0], block.body, expected))
    return found


def output_matches(expected: str, actual: str) -> bool:
    """Whether `actual` is `expected` with each `...` standing for any text (newlines
    included); trailing whitespace of lines and of the whole is ignored."""
    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip().splitlines())

    pattern = ".*?".join(re.escape(part) for part in norm(expected).split("..."))
    return re.fullmatch(pattern, norm(actual), re.S) is not None


def github_anchor(heading: str) -> str:
    """The id GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
