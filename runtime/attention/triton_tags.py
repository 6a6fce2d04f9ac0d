"""The `triton` backend's tag check: one batched device pass per step, before attention.

The same decision as `runtime.integrity.TagIntegrityTracker` (every page a scheduled sequence
reads must be the page it recorded, at the recorded tag, still held, with the recorded owner),
computed by the Triton `verify_pages` kernel over the step's [sequences, max_pages] tables in
one launch: a valid flag and a first cause per sequence. The pool's tags, owners and refcounts
live on the device (`DevicePoolState`, updated from the pool's change listener where pages are
allocated, shared, freed and retagged, never copied whole).

Two ways to learn the result. `verify_batch` reads the causes back (one copy) and returns the
violations before the step, as the host tracker does. `launch` reads nothing: attention
(`seq_valid`: an invalid sequence reads no KV, writes none, outputs zeros) and the sampler (an
invalid row samples `INVALID_TOKEN`) obey the flag on the device, and the engine learns of a
failed sequence from the token copy it already makes, then `explain`s it on the host (the rare
path) and aborts it with KV_INTEGRITY_VIOLATION, fail-closed. The engine launches where every
scheduled sequence samples this step (so each one's flag reaches a token) and verifies
otherwise (a mid-prompt chunk samples nothing).
"""

from __future__ import annotations

import time

import torch

from kernels.triton import launch
from kernels.verify_pages import CAUSES, ref_verify_pages
from runtime.integrity import TagIntegrityTracker, Violation, checked_entries
from runtime.kv.pages import PagePool, PageRef
from runtime.sampler import INVALID_TOKEN
from runtime.sequence import Sequence

__all__ = ["INVALID_TOKEN", "DevicePoolState", "DeviceTagIntegrityTracker", "to_device"]
# a flag the device failed that the host finds no reason for: still aborted (fail-closed)
MIRROR_MISMATCH = "device_mirror_mismatch"


def pairs_fields(pairs: list[tuple[PageRef, PageRef]]) -> list[tuple[int, int, int, int]]:
    """(actual page id, recorded page id, recorded tag, recorded owner) per entry."""
    return [(a.page_id, r.page_id, r.tag, r.owner) for a, r in pairs]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue: pinned, then copied
    asynchronously on CUDA (a pageable copy would wait); itself on CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class DevicePoolState:
    """The pool's tags, owner codes and refcounts as [num_pages] int64 tensors on `device`,
    kept in step with the host arrays: the pool's listener marks a page dirty, `flush` sends
    the dirty pages' values in one copy (two small ones: ids and values) before a pass.

    A separate copy on CPU too (not the zero-copy views), so that the CPU suite runs the path
    the GPU takes.
    """

    def __init__(self, pool: PagePool, device: torch.device) -> None:
        self.device = device
        self._host = (torch.frombuffer(pool.tags, dtype=torch.int64),
                      torch.frombuffer(pool.owner_codes, dtype=torch.int64),
                      torch.frombuffer(pool.refcounts, dtype=torch.int64))
        self.tensors = tuple(t.clone().to(device) for t in self._host)
        self._dirty: set[int] = set()
        self.pages_sent = 0  # dirty pages flushed so far (for tests and the bench)
        pool.listeners.append(self._dirty.add)

    def flush(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tags, owners, refcounts) on the device, current as of now."""
        if self._dirty:
            ids = torch.tensor(sorted(self._dirty), dtype=torch.long)
            self._dirty.clear()
            values = torch.stack([h.index_select(0, ids) for h in self._host])
            ids_d, values_d = to_device(ids, self.device), to_device(values, self.device)
            for t, v in zip(self.tensors, values_d, strict=True):
                t.index_copy_(0, ids_d, v)
            self.pages_sent += len(ids)
        return self.tensors  # type: ignore[return-value]


class EntryTables:
    """The step's [4, sequences, max entries] int64 table of what `verify_pages` checks (actual
    page id, recorded page id, tag, owner per entry of `checked_entries`) and the entry counts,
    without a Python pass over every entry every step: each sequence's rows are kept with
    snapshots of the two lists they came from, reused while the lists hold the same PageRefs
    (frozen: equal entries are equal values), extended by the new entries when both lists only
    grew, rebuilt otherwise. A list changed in place (a swapped or replaced entry) therefore
    never reuses stale rows; comparing the snapshots is C-level work per entry."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[tuple[PageRef, ...], tuple[PageRef, ...], torch.Tensor]] = {}
        self.entries_built = 0  # entries turned into rows in Python so far (tests, the bench)
        self.last_checked = 0  # entries in the last table built

    def rows(self, seq: Sequence) -> torch.Tensor:
        """[4, n] int64: `seq`'s entries as the kernel reads them."""
        table, recorded = tuple(seq.page_table), tuple(seq.recorded_pages)
        kept = self._rows.get(id(seq))
        if kept is not None and kept[0] == table and kept[1] == recorded:
            return kept[2]
        if (kept is not None and len(table) == len(recorded) and len(kept[0]) == len(kept[1])
                and table[:len(kept[0])] == kept[0] and recorded[:len(kept[1])] == kept[1]):
            n = len(kept[0])
            rows = torch.cat([kept[2], self._fields(list(zip(table[n:], recorded[n:],
                                                                strict=True)))], dim=1)
        else:
            rows = self._fields(checked_entries(seq))
        self._rows[id(seq)] = (table, recorded, rows)
        return rows

    def _fields(self, pairs: list[tuple[PageRef, PageRef]]) -> torch.Tensor:
        self.entries_built += len(pairs)
        return torch.tensor(pairs_fields(pairs), dtype=torch.int64).reshape(-1, 4).T

    def build(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [4, len(seqs), width] int64, entries per sequence [len(seqs)] int32), the
        padding past each count never read; rows of sequences not in `seqs` are dropped."""
        per_seq = [self.rows(seq) for seq in seqs]
        live = {id(seq) for seq in seqs}
        for key in [k for k in self._rows if k not in live]:
            del self._rows[key]
        counts = [r.shape[1] for r in per_seq]
        self.last_checked = sum(counts)
        table = torch.zeros(4, len(seqs), max(counts, default=0), dtype=torch.int64)
        for i, r in enumerate(per_seq):
            table[:, i, : r.shape[1]] = r
        return table, torch.tensor(counts, dtype=torch.int32)


class DeviceTagIntegrityTracker(TagIntegrityTracker):
    """`tags` on the device. `launch(seqs)`: one `verify_pages` launch, nothing read back;
    `verify_batch(seqs)`: the same, then the first bad page of each failed sequence, as the
    host tracker returns them. `last_valid`: [S] int32 on `device`, 1 where the sequence
    passed (order of the last `seqs`); `valid_rows` gives it in another order."""

    name = "tags"
    defers = True  # the engine may `launch` and learn of failures from the sampled tokens

    def __init__(self, pool: PagePool, device: torch.device) -> None:
        super().__init__(pool)
        self.device = device
        self.state = DevicePoolState(pool, device)
        self.tables = EntryTables()
        self.last_valid: torch.Tensor | None = None
        self._last_cause: torch.Tensor | None = None
        self._row_of: dict[int, int] = {}

    def launch(self, seqs: list[Sequence]) -> None:
        """The pass over `seqs`, its flags left on the device."""
        start = time.perf_counter()
        self._row_of = {id(seq): i for i, seq in enumerate(seqs)}
        table, lens = self.tables.build(seqs)
        if table.shape[2] == 0:
            self.last_valid = torch.ones(len(seqs), dtype=torch.int32, device=self.device)
            self._last_cause = torch.zeros(len(seqs), dtype=torch.int32, device=self.device)
            self.counters.count(0, [], start)
            return
        table, lens_d = to_device(table, self.device), to_device(lens, self.device)
        self.last_valid, self._last_cause = launch.verify_pages(
            table[0], table[1], table[2], table[3], lens_d, *self.state.flush())
        self.counters.count(self.tables.last_checked, [], start)

    def verify_batch(self, seqs: list[Sequence]) -> list[Violation]:
        self.launch(seqs)
        assert self._last_cause is not None
        causes = self._last_cause.tolist()  # the one copy back
        violations = [self._first_bad(seqs[s], checked_entries(seqs[s]))
                      for s, c in enumerate(causes) if c]
        self.counters.mismatches.update(v.cause for v in violations)
        return violations

    def valid_rows(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The last pass's flags for `seqs` (each one of its sequences), in `seqs`' order:
        [len(seqs)] int32 on the device (a gather, no host read); None before any pass."""
        if self.last_valid is None:
            return None
        rows = [self._row_of[id(seq)] for seq in seqs]
        if rows == list(range(len(self._row_of))):
            return self.last_valid
        return self.last_valid.index_select(0, to_device(torch.tensor(rows), self.device))

    def explain(self, seqs: list[Sequence]) -> list[Violation]:
        """Sequences whose flag the last `launch` cleared (they sampled `INVALID_TOKEN`): each
        one's first bad page, found again on the host, counted as a mismatch."""
        violations = [self._first_bad(seq, checked_entries(seq)) for seq in seqs]
        self.counters.mismatches.update(v.cause for v in violations)
        return violations

    def _first_bad(self, seq: Sequence, pairs: list[tuple[PageRef, PageRef]]) -> Violation:
        """The failed sequence's first bad entry, decided on the host (the rare path)."""
        if not pairs:
            return Violation(seq, 0, -1, -1, MIRROR_MISMATCH)
        ids = torch.tensor(pairs_fields(pairs))
        per_entry = ref_verify_pages(ids[:, 0], ids[:, 1], ids[:, 2], ids[:, 3], self._tags,
                                     self._owners, self._refcounts)
        bad = per_entry.nonzero().flatten().tolist()
        i = bad[0] if bad else 0
        page_id, tag = int(ids[i, 0]), int(ids[i, 2])
        found = self.pool.tags[page_id] if 0 <= page_id < self.pool.num_pages else -1
        cause = CAUSES[int(per_entry[i])] if bad else MIRROR_MISMATCH
        return Violation(seq, page_id, tag, found, cause)
