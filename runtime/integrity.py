"""Page integrity trackers: catch stale or foreign page mappings before a step reads KV.

`tags` (the default) runs one batched check per step over every page of every scheduled
sequence: the page table the model will read must name the pages the sequence recorded when
it got them, the tag recorded then must still be the page's tag, the page must still be held,
and its owner must be the one recorded (the sequence's tenant or a declared shared
namespace). Any mismatch aborts that sequence only, fail-closed. `off` has the same interface
and checks nothing, for deployments that disable it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kernels.verify_pages import CAUSES, verify_pages
from runtime.kv.pages import PagePool, PageRef
from runtime.sequence import Sequence

# Pads a table/record length mismatch: page 0 at tag -1 never matches a live page.
_NO_PAGE = PageRef(0, -1, -1)


def checked_entries(seq: Sequence) -> list[tuple[PageRef, PageRef]]:
    """(the page table's entry, what was recorded for it) for every page `seq` reads; a table
    and record of different lengths are padded with a page that never matches."""
    table, recorded = seq.page_table, seq.recorded_pages
    if len(table) != len(recorded):  # a page the allocator never gave, or one lost
        recorded = recorded + [_NO_PAGE] * (len(table) - len(recorded))
        table = table + [_NO_PAGE] * (len(recorded) - len(table))
    return list(zip(table, recorded, strict=True))


@dataclass(frozen=True)
class Violation:
    seq: Sequence
    page_id: int
    expected_tag: int
    found_tag: int
    cause: str


@dataclass
class IntegrityCounters:
    checks_run: int = 0
    pages_checked: int = 0
    mismatches: Counter[str] = field(default_factory=Counter)
    check_time_s: float = 0.0

    @property
    def num_mismatches(self) -> int:
        return sum(self.mismatches.values())

    def count(self, pages: int, violations: list[Violation], start_s: float) -> None:
        """One check of `pages` pages that found `violations`, begun at perf_counter `start_s`."""
        self.checks_run += 1
        self.pages_checked += pages
        for v in violations:
            self.mismatches[v.cause] += 1
        self.check_time_s += time.perf_counter() - start_s


class TagIntegrityTracker:
    name = "tags"

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.counters = IntegrityCounters()
        # Zero-copy views of the pool's arrays: the pool stays torch-free.
        self._tags = torch.frombuffer(pool.tags, dtype=torch.int64)
        self._owners = torch.frombuffer(pool.owner_codes, dtype=torch.int64)
        self._refcounts = torch.frombuffer(pool.refcounts, dtype=torch.int64)

    def verify_batch(self, seqs: list[Sequence]) -> list[Violation]:
        start = time.perf_counter()
        page_ids: list[int] = []
        expected_ids: list[int] = []
        tags: list[int] = []
        owners: list[int] = []
        bounds: list[int] = []
        for seq in seqs:
            for actual, ref in checked_entries(seq):
                page_ids.append(actual.page_id)
                expected_ids.append(ref.page_id)
                tags.append(ref.tag)
                owners.append(ref.owner)
            bounds.append(len(page_ids))
        violations: list[Violation] = []
        if page_ids:
            causes = verify_pages(torch.tensor(page_ids), torch.tensor(expected_ids),
                                  torch.tensor(tags), torch.tensor(owners), self._tags,
                                  self._owners, self._refcounts)
            bad = causes.nonzero().flatten().tolist()
            if bad:
                violations = self._explain(seqs, bounds, bad, causes, page_ids, tags)
        self.counters.count(len(page_ids), violations, start)
        return violations

    def _explain(self, seqs: list[Sequence], bounds: list[int], bad: list[int],
                 causes: torch.Tensor, page_ids: list[int], tags: list[int]) -> list[Violation]:
        """First bad page of each affected sequence."""
        out: list[Violation] = []
        seen: set[int] = set()
        s = 0
        for i in bad:
            while bounds[s] <= i:
                s += 1
            if s in seen:
                continue
            seen.add(s)
            pid = page_ids[i]
            out.append(Violation(seqs[s], pid, tags[i], self.pool.tags[pid],
                                 CAUSES[int(causes[i])]))
        return out


class NoopIntegrityTracker:
    name = "off"

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.counters = IntegrityCounters()

    def verify_batch(self, seqs: list[Sequence]) -> list[Violation]:
        return []


TRACKERS: dict[str, type[TagIntegrityTracker] | type[NoopIntegrityTracker]] = {
    "tags": TagIntegrityTracker,
    "off": NoopIntegrityTracker,
}
