"""Fault injection for tests and ops drills: the page-bookkeeping bugs other engines shipped.

Off by default and unreachable from a request: only code holding the engine object can build
a FaultInjector. Each method breaks one thing the way a real bug would, between two steps:
a use-after-free that hands a live page to another request, a spurious tag bump, a corrupted
page table (two entries swapped), a page freed while its writer still runs, and a prefix-cache
entry that comes back after its page was reused.
"""

from __future__ import annotations

from runtime.engine import LLMEngine
from runtime.kv.pages import FREE_OWNER, PageRef
from runtime.sequence import Sequence


class FaultInjector:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.pool = engine.pool

    def _seq(self, request_id: str) -> Sequence:
        seq = self.engine.requests.get(request_id)
        if seq is None or not seq.page_table:
            raise LookupError(f"request {request_id!r} is not running with pages")
        return seq

    def reassign_page(self, victim_id: str, thief_id: str, index: int = 0) -> int:
        """Use-after-free: free the victim's page and give it to the thief, who then writes it."""
        victim, thief = self._seq(victim_id), self._seq(thief_id)
        ref = victim.recorded_pages[index]
        self._force_free(ref.page_id)  # the buggy free; the victim still maps the page
        new = self.pool.allocate(thief.tenant)
        # The thief holds it for real; put it where the thief's next writes land.
        thief.page_table.append(new)
        thief.recorded_pages.append(new)
        return ref.page_id

    def bump_tag(self, request_id: str, index: int = 0) -> int:
        """A page's generation moves on under a sequence that still maps it."""
        page_id = self._seq(request_id).recorded_pages[index].page_id
        self.pool.tags[page_id] += 1
        self.pool.touch(page_id)
        return page_id

    def swap_entries(self, request_id: str, i: int = 0, j: int = -1) -> None:
        """A corrupted page table: the model reads two of the sequence's pages swapped."""
        table = self._seq(request_id).page_table
        table[i], table[j] = table[j], table[i]

    def free_early(self, request_id: str, index: int = -1) -> int:
        """Free a page while its writer is still running: the next allocation takes it."""
        ref = self._seq(request_id).recorded_pages[index]
        self._force_free(ref.page_id)
        return ref.page_id

    def resurrect_cache_entry(self, key: bytes) -> PageRef:
        """A prefix-cache entry comes back after its page was evicted and reused: the page
        now holds another request's KV under a newer tag."""
        cache = self.engine.prefix_cache
        if cache is None or key not in cache._index:
            raise LookupError("no such prefix-cache entry")
        stale = cache._index.pop(key)
        self._force_free(stale.page_id)
        reuse = self.pool.allocate("someone-else")
        k, v = self.engine.kv_cache.k, self.engine.kv_cache.v
        k[:, :, reuse.page_id].normal_()
        v[:, :, reuse.page_id].normal_()
        self.pool.release(reuse)
        cache._index[key] = stale
        return stale

    def _force_free(self, page_id: int) -> None:
        """Drop every hold on a page and put it first in line for the next allocation."""
        pool = self.pool
        pool.refcounts[page_id] = 0
        pool.owners[page_id] = FREE_OWNER
        pool.owner_codes[page_id] = 0
        if page_id in pool._free:
            pool._free.remove(page_id)
        pool._free.appendleft(page_id)
        pool.touch(page_id)
