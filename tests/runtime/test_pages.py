"""The page pool's bookkeeping: free list, tags, owners, refcounts. Torch-free, microseconds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kv.pages import FREE_OWNER, PageAccountingError, PagePool, PageRef


def test_new_pool_has_every_page_free_and_unowned():
    pool = PagePool(num_pages=5, page_size=4)
    assert pool.num_free_pages == 5
    assert pool.num_used_pages == 0
    assert pool.owners == [FREE_OWNER] * 5
    assert list(pool.refcounts) == [0] * 5
    pool.check_quiescent()


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_pool_rejects_non_positive_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


@pytest.mark.parametrize(
    ("num_tokens", "pages"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_pages_for_tokens_rounds_up_to_whole_pages(num_tokens, pages):
    assert PagePool(num_pages=4, page_size=4).pages_for_tokens(num_tokens) == pages


def test_can_allocate_counts_only_free_pages():
    pool = PagePool(num_pages=3, page_size=4)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)
    pool.allocate("a")
    assert pool.can_allocate(2)
    assert not pool.can_allocate(3)
    assert pool.can_allocate(0)


def test_allocate_hands_out_distinct_pages_until_the_pool_is_empty():
    pool = PagePool(num_pages=4, page_size=2)
    refs = [pool.allocate("a") for _ in range(4)]
    assert sorted(r.page_id for r in refs) == [0, 1, 2, 3]
    assert pool.num_free_pages == 0
    assert pool.num_used_pages == 4


def test_allocate_on_an_empty_pool_raises():
    pool = PagePool(num_pages=1, page_size=2)
    pool.allocate("a")
    with pytest.raises(PageAccountingError):
        pool.allocate("a")
    assert pool.num_used_pages == 1


def test_allocate_sets_the_owner_one_holder_and_a_fresh_tag():
    pool = PagePool(num_pages=2, page_size=2)
    ref = pool.allocate("tenant-a")
    assert pool.owners[ref.page_id] == "tenant-a"
    assert pool.refcounts[ref.page_id] == 1
    assert ref.tag == pool.tags[ref.page_id] == 1
    assert pool.is_live(ref)


def test_tag_changes_every_time_a_page_is_handed_out_again():
    pool = PagePool(num_pages=1, page_size=2)
    seen: list[PageRef] = []
    for _ in range(10):
        ref = pool.allocate("a")
        assert ref.page_id == 0
        assert all(ref.tag != old.tag for old in seen)
        assert all(not pool.is_live(old) for old in seen)
        seen.append(ref)
        pool.release(ref)
    assert [r.tag for r in seen] == sorted({r.tag for r in seen})


def test_tags_are_per_page_so_other_pages_keep_theirs():
    pool = PagePool(num_pages=2, page_size=2)
    a = pool.allocate("a")
    b = pool.allocate("b")
    pool.release(a)
    a2 = pool.allocate("a")
    assert a2.page_id == a.page_id and a2.tag == a.tag + 1
    assert pool.tags[b.page_id] == b.tag
    assert pool.is_live(b)


def test_release_of_the_only_holder_frees_the_page_and_clears_its_owner():
    pool = PagePool(num_pages=2, page_size=2)
    ref = pool.allocate("tenant-a")
    assert pool.release(ref) is True
    assert pool.owners[ref.page_id] == FREE_OWNER
    assert pool.refcounts[ref.page_id] == 0
    assert pool.num_free_pages == 2
    assert not pool.is_live(ref)
    pool.check_quiescent()


def test_owner_is_the_latest_allocation_owner_after_reuse():
    pool = PagePool(num_pages=1, page_size=2)
    pool.release(pool.allocate("tenant-a"))
    ref = pool.allocate("tenant-b")
    assert pool.owners[ref.page_id] == "tenant-b"


def test_double_free_raises():
    pool = PagePool(num_pages=2, page_size=2)
    ref = pool.allocate("a")
    pool.release(ref)
    with pytest.raises(PageAccountingError, match="double free"):
        pool.release(ref)
    assert pool.num_free_pages == 2
    pool.check_quiescent()


def test_release_of_a_page_never_handed_out_raises():
    pool = PagePool(num_pages=2, page_size=2)
    with pytest.raises(PageAccountingError):
        pool.release(PageRef(page_id=1, tag=0))
    pool.check_quiescent()


def test_release_with_a_stale_tag_raises_and_leaves_the_new_holder_intact():
    pool = PagePool(num_pages=1, page_size=2)
    old = pool.allocate("tenant-a")
    pool.release(old)
    new = pool.allocate("tenant-b")
    with pytest.raises(PageAccountingError, match="tag"):
        pool.release(old)
    assert pool.is_live(new)
    assert pool.refcounts[new.page_id] == 1
    assert pool.owners[new.page_id] == "tenant-b"
    assert pool.num_free_pages == 0


def test_release_with_a_tag_from_the_future_raises():
    pool = PagePool(num_pages=1, page_size=2)
    ref = pool.allocate("a")
    with pytest.raises(PageAccountingError):
        pool.release(PageRef(ref.page_id, ref.tag + 1))
    assert pool.is_live(ref)


def test_share_adds_a_holder_and_the_page_frees_only_after_the_last_release():
    pool = PagePool(num_pages=2, page_size=2)
    ref = pool.allocate("a")
    assert pool.share(ref) == ref
    assert pool.share(ref) == ref
    assert pool.refcounts[ref.page_id] == 3
    assert pool.num_used_pages == 1
    assert pool.release(ref) is False
    assert pool.release(ref) is False
    assert pool.is_live(ref)
    assert pool.owners[ref.page_id] == "a"
    assert pool.release(ref) is True
    assert not pool.is_live(ref)
    pool.check_quiescent()


def test_share_keeps_the_tag_so_every_holder_records_the_same_ref():
    pool = PagePool(num_pages=1, page_size=2)
    ref = pool.allocate("a")
    tag = pool.tags[ref.page_id]
    pool.share(ref)
    assert pool.tags[ref.page_id] == tag


def test_share_of_a_free_page_raises():
    pool = PagePool(num_pages=1, page_size=2)
    ref = pool.allocate("a")
    pool.release(ref)
    with pytest.raises(PageAccountingError):
        pool.share(ref)
    assert pool.refcounts[ref.page_id] == 0


def test_share_with_a_stale_tag_raises():
    pool = PagePool(num_pages=1, page_size=2)
    old = pool.allocate("a")
    pool.release(old)
    new = pool.allocate("b")
    with pytest.raises(PageAccountingError):
        pool.share(old)
    assert pool.refcounts[new.page_id] == 1


def test_freed_pages_are_reused_oldest_first_and_before_never_used_ones():
    # NOTE: never-used pages are not resident yet (the OS commits KV memory on first write);
    # among used ones the oldest freed goes first, keeping a just-freed (page, tag) out longest.
    pool = PagePool(num_pages=5, page_size=2)
    first, second, third = (pool.allocate("a") for _ in range(3))
    pool.release(second)
    pool.release(first)
    assert pool.num_free_pages == 4
    assert [pool.allocate("a").page_id for _ in range(4)] == [second.page_id, first.page_id, 3, 4]
    assert pool.num_free_pages == 0 and not pool.can_allocate(1)
    with pytest.raises(PageAccountingError):
        pool.allocate("a")
    assert third.page_id == 2


def test_check_quiescent_passes_when_every_page_is_back():
    pool = PagePool(num_pages=4, page_size=2)
    refs = [pool.allocate("a") for _ in range(4)]
    pool.share(refs[0])
    for ref in refs:
        pool.release(ref)
    pool.release(refs[0])
    pool.check_quiescent()


def test_check_quiescent_raises_while_a_page_is_held():
    pool = PagePool(num_pages=4, page_size=2)
    pool.allocate("a")
    with pytest.raises(PageAccountingError, match="not quiescent"):
        pool.check_quiescent()


def test_check_quiescent_raises_while_a_shared_page_has_a_holder_left():
    pool = PagePool(num_pages=2, page_size=2)
    ref = pool.allocate("a")
    pool.share(ref)
    pool.release(ref)
    with pytest.raises(PageAccountingError):
        pool.check_quiescent()


def test_check_quiescent_raises_on_a_corrupted_free_list():
    pool = PagePool(num_pages=2, page_size=2)
    pool._free.append(0)  # the same page twice on the free list
    with pytest.raises(PageAccountingError):
        pool.check_quiescent()


# Random allocate/share/release programs against a plain model of who holds what.
_ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "share", "release", "stale"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 6), ops=_ops)
def test_random_programs_keep_refcounts_tags_and_owners_consistent(num_pages, ops):
    pool = PagePool(num_pages=num_pages, page_size=4)
    held: list[tuple[PageRef, str]] = []  # one entry per holder
    released: list[PageRef] = []
    last_tag = [0] * num_pages
    for op, pick in ops:
        if op == "allocate":
            if not pool.can_allocate(1):
                with pytest.raises(PageAccountingError):
                    pool.allocate("x")
                continue
            owner = f"t{pick % 3}"
            ref = pool.allocate(owner)
            assert ref.tag > last_tag[ref.page_id]
            last_tag[ref.page_id] = ref.tag
            held.append((ref, owner))
        elif op == "share" and held:
            ref, owner = held[pick % len(held)]
            held.append((pool.share(ref), owner))
        elif op == "release" and held:
            ref, _ = held.pop(pick % len(held))
            freed = pool.release(ref)
            assert freed == all(r.page_id != ref.page_id for r, _ in held)
            released.append(ref)
        elif op == "stale" and released:
            ref = released[pick % len(released)]
            if pool.is_live(ref):
                continue  # that page has another holder at the same tag: not stale
            with pytest.raises(PageAccountingError):
                pool.release(ref)
            with pytest.raises(PageAccountingError):
                pool.share(ref)

        holders = [0] * num_pages
        for ref, owner in held:
            holders[ref.page_id] += 1
            assert pool.is_live(ref)
            assert pool.owners[ref.page_id] == owner
            assert pool.tags[ref.page_id] == ref.tag
        assert list(pool.refcounts) == holders
        assert pool.num_used_pages == sum(1 for h in holders if h)
        for page_id in range(num_pages):
            if not holders[page_id]:
                assert pool.owners[page_id] == FREE_OWNER

    for ref, _ in held:
        pool.release(ref)
    pool.check_quiescent()
