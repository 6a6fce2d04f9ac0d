"""Fault injection for tests and ops drills: the page-bookkeeping bugs other engines shipped.

Off by default and unreachable from a request: only code holding the engine object can build
a FaultInjector. Each method breaks one thing the way a real bug would, between two steps:
a use-after-free that hands a live page to another request, a spurious tag bump, a corrupted
page table (two entries swapped), and a page freed while its writer still runs.
"""

from __future__ import annotations

from runtime.engine import LLMEngine
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
        self.pool.release(ref)  # the buggy free; the victim still maps the page
        self.pool._free.remove(ref.page_id)
        self.pool._free.appendleft(ref.page_id)
        new = self.pool.allocate(thief.tenant)
        # The thief holds it for real; put it where the thief's next writes land.
        thief.page_table.append(new)
        thief.recorded_pages.append(new)
        return ref.page_id

    def bump_tag(self, request_id: str, index: int = 0) -> int:
        """A page's generation moves on under a sequence that still maps it."""
        page_id = self._seq(request_id).recorded_pages[index].page_id
        self.pool.tags[page_id] += 1
        return page_id

    def swap_entries(self, request_id: str, i: int = 0, j: int = -1) -> None:
        """A corrupted page table: the model reads two of the sequence's pages swapped."""
        table = self._seq(request_id).page_table
        table[i], table[j] = table[j], table[i]

    def free_early(self, request_id: str, index: int = -1) -> int:
        """Free a page while its writer is still running: the next allocation takes it."""
        ref = self._seq(request_id).recorded_pages[index]
        self.pool.release(ref)
        self.pool._free.remove(ref.page_id)
        self.pool._free.appendleft(ref.page_id)
        return ref.page_id
