"""The page pool: which physical KV pages are free, who holds them, and their generation tags.

Plain Python over ints (no torch): the scheduler and the integrity check ask it questions
thousands of times a second. A physical page is identified by its id; every time it is handed
out its `tag` is bumped, so a stale `(page_id, tag)` recorded by a sequence can be told apart
from the page's current life. `owner` is the tenant (or shared namespace) the page belongs to.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

FREE_OWNER = ""


class PageAccountingError(RuntimeError):
    """A bookkeeping invariant broke (double free, free of a page not held). Always a bug."""


@dataclass(frozen=True)
class PageRef:
    """What a sequence records when it is given a page."""

    page_id: int
    tag: int
    owner: int = 0  # the pool's code for the owner the page had when it was recorded


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive ({num_pages}, {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        # NOTE: fixed-size int64 arrays, never resized: the integrity tracker reads them
        # zero-copy as tensors.
        self.tags = array("q", bytes(8 * num_pages))
        self.refcounts = array("q", bytes(8 * num_pages))
        self.owner_codes = array("q", bytes(8 * num_pages))
        self.owners = [FREE_OWNER] * num_pages
        self._codes: dict[str, int] = {FREE_OWNER: 0}
        # NOTE: the KV tensors' pages are committed by the OS on first write, so a page that
        # was written before is reused before any never-used one: a worker's resident KV
        # stays at its peak use instead of walking the whole pool. Among written pages the
        # oldest freed goes first, keeping a just-freed (page, tag) out of circulation longest.
        self._free: deque[int] = deque()  # free pages written before, oldest freed first
        self._unused_from = 0  # pages [_unused_from, num_pages) were never handed out
        # called with a page id whenever its tag, owner or refcount changes (a device mirror
        # of these arrays, runtime/attention/triton_tags.py, follows them this way)
        self.listeners: list[Callable[[int], None]] = []

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + self.num_pages - self._unused_from

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def owner_code(self, owner: str) -> int:
        code = self._codes.get(owner)
        if code is None:
            code = self._codes[owner] = len(self._codes)
        return code

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, owner: str) -> PageRef:
        if self._free:
            page_id = self._free.popleft()
        elif self._unused_from < self.num_pages:
            page_id, self._unused_from = self._unused_from, self._unused_from + 1
        else:
            raise PageAccountingError("allocate() on an empty pool; call can_allocate() first")
        if self.refcounts[page_id] != 0:
            raise PageAccountingError(f"page {page_id} on the free list has holders")
        self.tags[page_id] += 1
        self.owners[page_id] = owner
        self.owner_codes[page_id] = code = self.owner_code(owner)
        self.refcounts[page_id] = 1
        self.touch(page_id)
        return PageRef(page_id, self.tags[page_id], code)

    def share(self, ref: PageRef) -> PageRef:
        """Add a holder to a live page (prefix-cache hit). The caller records the same tag."""
        self._check_id(ref.page_id)
        if self.refcounts[ref.page_id] <= 0 or self.tags[ref.page_id] != ref.tag:
            raise PageAccountingError(f"share() of a page not live at tag {ref.tag}: {ref}")
        self.refcounts[ref.page_id] += 1
        self.touch(ref.page_id)
        return ref

    def release(self, ref: PageRef) -> bool:
        """Drop one holder; returns True when the page went back to the free list."""
        page_id = ref.page_id
        self._check_id(page_id)
        if self.refcounts[page_id] <= 0:
            raise PageAccountingError(f"release() of free page {page_id} (double free)")
        if self.tags[page_id] != ref.tag:
            raise PageAccountingError(
                f"release() of page {page_id} at tag {ref.tag}, but it is at {self.tags[page_id]}"
            )
        self.refcounts[page_id] -= 1
        freed = self.refcounts[page_id] == 0
        if freed:
            self.owners[page_id] = FREE_OWNER
            self.owner_codes[page_id] = 0
            self._free.append(page_id)
        self.touch(page_id)
        return freed

    def retag(self, ref: PageRef) -> PageRef:
        """A fresh generation for a page its one holder is about to publish (a KV import):
        any copy of the old ref, kept by anyone, stops matching."""
        self._check_id(ref.page_id)
        if self.refcounts[ref.page_id] != 1 or self.tags[ref.page_id] != ref.tag:
            raise PageAccountingError(f"retag() of a page not held once at tag {ref.tag}: {ref}")
        self.tags[ref.page_id] += 1
        self.touch(ref.page_id)
        return PageRef(ref.page_id, self.tags[ref.page_id], ref.owner)

    def touch(self, page_id: int) -> None:
        """Tell the listeners that page `page_id`'s tag, owner or refcount changed (the pool's
        own methods do; code that writes the arrays directly, a fault drill, must too)."""
        for listener in self.listeners:
            listener(page_id)

    def _check_id(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise PageAccountingError(f"page id {page_id} outside the pool of {self.num_pages}")

    def is_live(self, ref: PageRef) -> bool:
        if not 0 <= ref.page_id < self.num_pages:
            return False
        return self.refcounts[ref.page_id] > 0 and self.tags[ref.page_id] == ref.tag

    def check_quiescent(self) -> None:
        """Raise if any page is still held: call when no request is in flight."""
        held = [p for p in range(self.num_pages) if self.refcounts[p] != 0]
        free = [*self._free, *range(self._unused_from, self.num_pages)]
        if held or len(free) != self.num_pages or len(set(free)) != self.num_pages:
            raise PageAccountingError(
                f"pool not quiescent: {len(held)} pages held, {len(free)} free"
            )
