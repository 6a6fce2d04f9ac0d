"""The `triton` backend's tag check: one batched device pass per step, before attention.

The same decision as `runtime.integrity.TagIntegrityTracker` (every page a scheduled sequence
reads must be the page it recorded, at the recorded tag, still held, with the recorded owner),
computed by the Triton `verify_pages` kernel over the step's [sequences, max_pages] tables in
one launch: a valid flag and a first cause per sequence. A failed sequence becomes the same
`Violation` (the engine aborts it with KV_INTEGRITY_VIOLATION, fail-closed), and its flag is
kept in `last_valid` for kernels that obey one (`launch.paged_attention(seq_valid=...)`).
"""

from __future__ import annotations

import time

import torch

from kernels.triton import launch
from kernels.verify_pages import CAUSES, ref_verify_pages
from runtime.integrity import TagIntegrityTracker, Violation, checked_entries
from runtime.kv.pages import PagePool, PageRef
from runtime.sequence import Sequence


def pairs_fields(pairs: list[tuple[PageRef, PageRef]]) -> list[tuple[int, int, int, int]]:
    """(actual page id, recorded page id, recorded tag, recorded owner) per entry."""
    return [(a.page_id, r.page_id, r.tag, r.owner) for a, r in pairs]


class DeviceTagIntegrityTracker(TagIntegrityTracker):
    """`tags` on the device: `verify_batch(seqs)` runs one `verify_pages` launch and returns
    the first bad page of each failed sequence, as the host tracker does. `last_valid`: [S]
    int32 on `device`, 1 where the sequence passed (order of the last `seqs`)."""

    name = "tags"

    def __init__(self, pool: PagePool, device: torch.device) -> None:
        super().__init__(pool)
        self.device = device
        self.last_valid: torch.Tensor | None = None

    def _pool_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool's tags, owner codes and refcounts on the device. On CPU: the zero-copy
        views. Elsewhere: copied each step, until the pool keeps device mirrors of its own."""
        views = (self._tags, self._owners, self._refcounts)
        if self.device.type == "cpu":
            return views
        return tuple(t.to(self.device, non_blocking=True) for t in views)  # type: ignore[return-value]

    def verify_batch(self, seqs: list[Sequence]) -> list[Violation]:
        start = time.perf_counter()
        entries = [checked_entries(seq) for seq in seqs]
        width = max((len(e) for e in entries), default=0)
        if width == 0:
            self.last_valid = torch.ones(len(seqs), dtype=torch.int32, device=self.device)
            self.counters.count(0, [], start)
            return []
        # rows: actual page, recorded page, recorded tag, recorded owner; padded with entries
        # never read (num_entries bounds each row)
        rows: list[list[int]] = [[], [], [], []]
        for pairs in entries:
            fields = pairs_fields(pairs) + [(0, 0, 0, 0)] * (width - len(pairs))
            for row, values in zip(rows, zip(*fields, strict=True), strict=True):
                row.extend(values)
        table = torch.tensor(rows, dtype=torch.int64).view(4, len(seqs), width).to(self.device)
        lens = torch.tensor([len(e) for e in entries], dtype=torch.int32, device=self.device)
        valid, cause = launch.verify_pages(table[0], table[1], table[2], table[3], lens,
                                           *self._pool_state())
        self.last_valid = valid
        causes = cause.tolist()  # the one copy back (the step's token copy, on the GPU path)
        violations = [self._first_bad(seqs[s], entries[s], c)
                      for s, c in enumerate(causes) if c]
        self.counters.count(sum(len(e) for e in entries), violations, start)
        return violations

    def _first_bad(self, seq: Sequence, pairs: list[tuple[PageRef, PageRef]],
                   cause: int) -> Violation:
        """The failed sequence's first bad entry, found again on the host (the rare path)."""
        ids = torch.tensor(pairs_fields(pairs))
        per_entry = ref_verify_pages(ids[:, 0], ids[:, 1], ids[:, 2], ids[:, 3], self._tags,
                                     self._owners, self._refcounts)
        bad = per_entry.nonzero().flatten().tolist()
        i = bad[0] if bad else 0
        page_id, tag = int(ids[i, 0]), int(ids[i, 2])
        return Violation(seq, page_id, tag, self.pool.tags[page_id], CAUSES[cause])
