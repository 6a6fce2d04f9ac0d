"""The batched tag check in Triton (kernels/triton/verify_pages.py) in the interpreter: per
sequence, valid iff every entry passes, and the first bad entry's cause, each decided as the
torch twin `ref_verify_pages` decides, over a real PagePool of 40k pages with stale, foreign,
freed and remapped pages planted in some sequences only."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels.triton import launch
from kernels.verify_pages import (
    FOREIGN_OWNER,
    FREED_PAGE,
    OK,
    REMAPPED,
    STALE_TAG,
    ref_verify_pages,
)
from runtime.kv.pages import PagePool


def _device_view(tables, records):
    """Padded [S, max_pages] tensors of what attention reads and what each sequence recorded."""
    width = max(len(t) for t in tables)

    def pad(rows):
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)

    return tuple(t.to(DEVICE) for t in (
        pad(tables), pad([[r.page_id for r in rec] for rec in records]),
        pad([[r.tag for r in rec] for rec in records]),
        pad([[r.owner for r in rec] for rec in records]),
        torch.tensor([len(t) for t in tables], dtype=torch.int32)))


def test_tag_pass_fails_exactly_the_sequences_the_torch_check_fails():
    pool = PagePool(40_000, 16)
    gen = torch.Generator().manual_seed(0)
    # spread allocations over the pool: burn through most pages first
    burn = [pool.allocate("warm") for _ in range(39_000)]
    for ref in burn[::2]:
        pool.release(ref)
    owners = ["a", "b", "a", "c", "b", "a", "c"]
    records = [[pool.allocate(o) for _ in range(int(torch.randint(1, 700, (1,), generator=gen)))]
               for o in owners]
    tables = [[r.page_id for r in rec] for rec in records]
    # seq 1: a page freed and handed to someone else (stale tag, and foreign owner)
    victim = records[1][5]
    pool.release(victim)
    while pool.allocate("c").page_id != victim.page_id:
        pass
    # seq 3: a page freed (no holder)
    pool.release(records[3][-1])
    # seq 4: its table remapped to another live page than the one recorded
    tables[4][100] = records[0][0].page_id
    # seq 6: a page id outside the pool, in its table and its record alike
    tables[6][0] = 10**9
    page_table, ids, tags, own, counts = _device_view(tables, records)
    ids[6, 0] = 10**9
    pool_tags, pool_owners, pool_refs = (torch.frombuffer(a, dtype=torch.int64).to(DEVICE)
                                         for a in (pool.tags, pool.owner_codes, pool.refcounts))
    valid, cause = launch.verify_pages(page_table, ids, tags, own, counts, pool_tags,
                                       pool_owners, pool_refs, block=256)
    for s in range(len(owners)):
        n = len(tables[s])
        if s == 6:  # the twin cannot even index it; the pass fails it closed
            assert int(valid[s]) == 0 and int(cause[s]) == FREED_PAGE
            continue
        want = ref_verify_pages(page_table[s, :n], ids[s, :n], tags[s, :n], own[s, :n],
                                pool_tags, pool_owners, pool_refs)
        bad = want.nonzero().flatten()
        assert int(valid[s]) == int(bad.numel() == 0), s
        assert int(cause[s]) == (int(want[bad[0]]) if bad.numel() else OK), s
    assert [int(c) for c in cause] == [OK, STALE_TAG, OK, FREED_PAGE, REMAPPED, OK, FREED_PAGE]
    assert FOREIGN_OWNER not in cause.tolist()  # stale wins over foreign, as in the twin
