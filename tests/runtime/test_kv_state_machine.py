"""Stateful property test over the page pool, the tenant-salted prefix cache and tenant quotas.

Hypothesis interleaves admissions, engine steps (prefill chunks, growth, preemption, cache
inserts and hits), finishes, aborts, evictions and full quiescence across three tenants whose
prompts share prefixes, on a small pool. After every rule it checks what issue 4 promises: no
page held across tenants, refcounts equal to holders, tags strictly increasing on reuse, cache
hits only within a tenant and only of the right tokens, quotas respected, no leak at
quiescence. The oracle is a shadow of every page life's contents: `(page_id, tag)` -> the
tenant and the tokens written into it. Torch-free: plain Python over ids.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from runtime.kv.pages import FREE_OWNER, PagePool, PageRef
from runtime.kv.prefix import PrefixCache
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Sequence, SequenceStatus

PAGE_SIZE = 4
TENANTS = ("acme", "globex", "initech")
# Shared prefixes (a system prompt, a longer one that extends it, one ending mid-page), so
# the same tenant hits its own pages and the other tenants send the very same tokens.
PREFIXES = (
    (),
    tuple(range(101, 109)),
    tuple(range(101, 113)),
    tuple(range(201, 207)),
    tuple(range(301, 317)),
    tuple(range(301, 325)),
)
_request_ids = itertools.count()


def next_token(token_ids: list[int]) -> int:
    """A deterministic stand-in for greedy decoding: equal prefixes give equal outputs."""
    return 1 + (31 * token_ids[-1] + len(token_ids)) % 3


def with_allocation_log(pool_cls: type[PagePool]) -> type[PagePool]:
    """`pool_cls` that also logs the tag of every fresh allocation, per page."""

    class LoggedPool(pool_cls):  # type: ignore[valid-type, misc]
        def __init__(self, num_pages: int, page_size: int) -> None:
            super().__init__(num_pages, page_size)
            self.allocated_tags: list[list[int]] = [[] for _ in range(num_pages)]

        def allocate(self, owner: str) -> PageRef:
            ref = super().allocate(owner)
            self.allocated_tags[ref.page_id].append(ref.tag)
            return ref

    return LoggedPool


class KVMachine(RuleBasedStateMachine):
    pool_cls: ClassVar[type[PagePool]] = PagePool
    cache_cls: ClassVar[type[PrefixCache]] = PrefixCache
    scheduler_cls: ClassVar[type[Scheduler]] = Scheduler
    # Where set, one summary per run that drained cleanly (the coverage test reads them).
    runs: ClassVar[list[dict[str, Any]] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.seqs: list[Sequence] = []
        self.written: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
        self.last_tags: list[int] = []
        self.hit_pages = 0
        self.admitted = 0
        self.explicit_evictions = 0

    # -- setup ------------------------------------------------------------------------------

    @initialize(num_pages=st.integers(12, 32), quota=st.sampled_from([1.0, 0.75, 0.5, 1.0, 0.4]),
                budget=st.sampled_from([3, 8, 16, 64]), max_num_seqs=st.integers(2, 12),
                watermark=st.sampled_from([0.0, 0.1]))
    def start(self, num_pages: int, quota: float, budget: int, max_num_seqs: int,
              watermark: float) -> None:
        self.pool = with_allocation_log(self.pool_cls)(num_pages, PAGE_SIZE)
        self.cache = self.cache_cls(self.pool)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 admission_watermark=watermark, tenant_page_quota=quota)
        self.sched = self.scheduler_cls(config, self.pool, self.cache)
        self.max_model_len = num_pages * PAGE_SIZE
        self.last_tags = [0] * num_pages

    @property
    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    # -- rules ------------------------------------------------------------------------------

    @rule(requests=st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(PREFIXES),
                                      st.lists(st.integers(1, 3), max_size=6),
                                      st.integers(1, 16)), min_size=1, max_size=4))
    def admit(self, requests: list[tuple[str, tuple[int, ...], list[int], int]]) -> None:
        assert self.sched is not None
        for tenant, prefix, suffix, max_tokens in requests:
            prompt = [*prefix, *suffix] or [1]
            # The engine refuses these at add_request (CONTEXT_LENGTH_EXCEEDED,
            # TENANT_QUOTA_EXCEEDED); the scheduler never sees them.
            longest = len(prompt) + max_tokens
            if (longest > self.max_model_len
                    or self.pool.pages_for_tokens(longest) > self.sched.quota_pages):
                continue
            seq = Sequence(f"req-{next(_request_ids)}", prompt,
                           SamplingParams(max_tokens=max_tokens), tenant=tenant)
            self.seqs.append(seq)
            self.sched.add(seq)
            self.admitted += 1

    @rule(count=st.integers(1, 4))
    def step(self, count: int) -> None:
        for _ in range(count):
            self.engine_step()
            self.check_everything()

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        assert self.sched is not None
        unfinished = self.unfinished
        seq = unfinished[data.draw(st.integers(0, len(unfinished) - 1), label="finish")]
        self.sched.finish(seq)
        assert seq.is_finished and seq.recorded_pages == [] and seq.page_table == []

    @rule(num_pages=st.integers(1, 6))
    def evict(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable
        freed = self.cache.evict(num_pages)
        assert freed == min(num_pages, evictable), f"evicted {freed} of {evictable} evictable"
        self.explicit_evictions += freed

    @rule(dice=st.integers(0, 3))
    def quiesce(self, dice: int) -> None:
        """Every request ends (one time in four): only the cache's own holds may remain."""
        assert self.sched is not None
        if dice:
            return
        for seq in self.unfinished:
            self.sched.finish(seq)
        assert self.sched.num_unfinished == 0
        self.cache.check_quiescent()

    # -- the engine loop without a model ----------------------------------------------------

    def engine_step(self) -> None:
        sched = self.sched
        assert sched is not None
        pending = sched.num_unfinished > 0
        was_running = {id(s) for s in sched.running}
        out = sched.schedule()
        assert not pending or not out.is_empty, "the scheduler made no progress with work pending"
        scheduled = {id(item.seq) for item in out.scheduled}
        skipped = [s.request_id for s in sched.running if id(s) not in scheduled]
        assert not skipped or out.num_tokens == sched.config.max_num_batched_tokens, (
            f"running {skipped} skipped with token budget left")
        self.check_allocations()
        for item in out.scheduled:
            if id(item.seq) not in was_running:
                self.check_hits(item.seq)
        # NOTE: `samples` reads num_computed_tokens, so it is taken before the advance (as the
        # model runner does).
        samplers = [item.seq for item in out.scheduled if item.samples]
        for item in out.scheduled:
            start = item.seq.num_computed_tokens
            item.seq.num_computed_tokens += item.num_tokens
            self.record_writes(item.seq, start, item.seq.num_computed_tokens)
            sched.cache_full_pages(item.seq)
        for seq in samplers:
            seq.output_token_ids.append(next_token(seq.token_ids))
            if (len(seq.output_token_ids) >= seq.max_tokens
                    or seq.num_tokens >= self.max_model_len):
                sched.finish(seq)

    def check_hits(self, seq: Sequence) -> None:
        """A sequence just admitted: its first num_pages_cached pages are cache hits."""
        ps = PAGE_SIZE
        for i, ref in enumerate(seq.recorded_pages[: seq.num_pages_cached]):
            tenant, tokens = self.written.get((ref.page_id, ref.tag), (None, ()))
            assert tenant == seq.tenant and self.pool.owners[ref.page_id] == seq.tenant, (
                f"cache hit crosses tenants: {seq.tenant}'s {seq.request_id} got page "
                f"{ref.page_id} written by {tenant}, owned by {self.pool.owners[ref.page_id]!r}")
            assert tokens == tuple(seq.token_ids[i * ps : (i + 1) * ps]), (
                f"cache hit serves page {ref.page_id} with other tokens than {seq.request_id}'s")
        self.hit_pages += seq.num_pages_cached

    def record_writes(self, seq: Sequence, start: int, end: int) -> None:
        """Tokens [start, end) were written into the sequence's pages: its own, in order."""
        ps = PAGE_SIZE
        for i in range(start // ps, (end - 1) // ps + 1):
            ref = seq.recorded_pages[i]
            key = (ref.page_id, ref.tag)
            lo = i * ps
            before = tuple(seq.token_ids[lo:start])
            assert self.pool.refcounts[ref.page_id] == 1, (
                f"{seq.request_id} writes page {ref.page_id}, which others hold too")
            assert self.written.get(key, (seq.tenant, ())) == (seq.tenant, before), (
                f"page {ref.page_id} at tag {ref.tag} already holds another life's tokens "
                f"(tag not bumped on reuse?)")
            self.written[key] = (seq.tenant, tuple(seq.token_ids[lo : min(lo + ps, end)]))

    # -- invariants -------------------------------------------------------------------------

    def check_allocations(self) -> None:
        for page_id, tags in enumerate(self.pool.allocated_tags):
            assert all(a < b for a, b in itertools.pairwise(tags)), (
                f"page {page_id} reused without a newer tag: allocated at tags {tags}")
            assert self.pool.tags[page_id] >= self.last_tags[page_id], (
                f"page {page_id}'s tag went back from {self.last_tags[page_id]}")
            self.last_tags[page_id] = self.pool.tags[page_id]

    def check_pages(self) -> None:
        sched, pool = self.sched, self.pool
        assert sched is not None
        running, waiting = list(sched.running), list(sched.waiting)
        assert {id(s) for s in running + waiting} == {id(s) for s in self.unfinished}
        assert len(running) + len(waiting) == len(self.unfinished)
        holders: Counter[int] = Counter()
        for seq in waiting + [s for s in self.seqs if s.is_finished]:
            assert seq.recorded_pages == [] and seq.page_table == [], (
                f"{seq.request_id} ({seq.status.value}) still holds pages")
        for seq in running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.page_table == seq.recorded_pages
            assert len(seq.page_table) == pool.pages_for_tokens(seq.num_computed_tokens)
            assert len({r.page_id for r in seq.recorded_pages}) == len(seq.recorded_pages)
            for ref in seq.recorded_pages:
                assert pool.is_live(ref), f"{seq.request_id} holds a dead page {ref}"
                owner = pool.owners[ref.page_id]
                assert owner == seq.tenant, (
                    f"page {ref.page_id} is owned by {owner!r} and held by {seq.tenant!r}'s "
                    f"{seq.request_id}: a page of two tenants")
                holders[ref.page_id] += 1
        # NOTE: the index is private; the invariant is about exactly what it holds.
        entries = list(self.cache._index.values())
        assert len({r.page_id for r in entries}) == len(entries), "a page under two cache keys"
        for ref in entries:
            assert pool.is_live(ref), f"the cache indexes a dead page {ref}"
            tenant, tokens = self.written.get((ref.page_id, ref.tag), (None, ()))
            assert tenant == pool.owners[ref.page_id] and len(tokens) == PAGE_SIZE, (
                f"cached page {ref.page_id} is not a full page written by its owner")
            holders[ref.page_id] += 1
        for page_id in range(pool.num_pages):
            assert pool.refcounts[page_id] == holders[page_id], (
                f"page {page_id} has refcount {pool.refcounts[page_id]} but "
                f"{holders[page_id]} holders")
            if not holders[page_id]:
                assert pool.owners[page_id] == FREE_OWNER
        assert pool.num_free_pages == pool.num_pages - len(holders)

    def check_quota(self) -> None:
        sched = self.sched
        assert sched is not None
        if sched.config.tenant_page_quota < 1.0:
            for tenant in TENANTS:
                assert sched.tenant_pages(tenant) <= sched.quota_pages, (
                    f"{tenant} holds {sched.tenant_pages(tenant)} pages, over its quota of "
                    f"{sched.quota_pages}")

    def check_everything(self) -> None:
        self.check_allocations()
        self.check_pages()
        self.check_quota()

    @invariant()
    def invariants_hold(self) -> None:
        if self.sched is not None:
            self.check_everything()

    def teardown(self) -> None:
        if self.sched is None:
            return
        for _ in range(5_000):
            if not self.sched.num_unfinished:
                break
            self.engine_step()
            self.check_everything()
        assert all(s.is_finished for s in self.seqs), "requests never finished"
        self.cache.check_quiescent()
        self.cache.clear()
        self.pool.check_quiescent()
        if self.runs is not None:
            self.runs.append({
                "quota": self.sched.config.tenant_page_quota < 1.0,
                "admitted": self.admitted,
                "hit_pages": self.hit_pages,
                "preemptions": self.sched.num_preemptions,
                "evictions": self.cache.evictions - self.explicit_evictions,
            })


def run_machine(machine: type[KVMachine], max_examples: int, **kwargs: Any) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow], **kwargs))


class CountingMachine(KVMachine):
    runs: ClassVar[list[dict[str, Any]]] = []


class RandomMachine(KVMachine):
    runs: ClassVar[list[dict[str, Any]]] = []


def test_pool_cache_and_quotas_keep_their_invariants_under_random_interleavings():
    """The invariants are asserted inside the machine after every rule; here: it really ran,
    and every run that admitted work drained to a quiescent pool (teardown records only then)."""
    RandomMachine.runs.clear()
    run_machine(RandomMachine, max_examples=100)
    assert len(RandomMachine.runs) >= 50
    assert any(r["admitted"] for r in RandomMachine.runs)


def test_the_machine_really_exercises_hits_preemption_eviction_and_quotas():
    """Derandomized, so the counts are stable: a change that starves the machine of hits,
    preemptions or evictions fails here instead of silently testing less."""
    CountingMachine.runs.clear()
    run_machine(CountingMachine, max_examples=150, derandomize=True, database=None)
    busy = [r for r in CountingMachine.runs if r["admitted"] >= 3]
    assert len(busy) >= 50

    def runs_with(key: str, quota: bool | None = None) -> int:
        return sum(r[key] > 0 for r in busy if quota is None or r["quota"] is quota)

    assert runs_with("hit_pages") >= 0.3 * len(busy), "too few runs with cache hits"
    assert runs_with("preemptions") >= 0.1 * len(busy), "too few runs with preemptions"
    assert runs_with("preemptions", quota=False) >= 3, "the pool never ran short"
    assert runs_with("preemptions", quota=True) >= 3, "no preemption under a quota"
    assert runs_with("evictions") >= 0.1 * len(busy), "the scheduler rarely had to evict"


def test_a_victims_cached_pages_are_evicted_before_another_sequence_is_preempted():
    """A regression the machine found: a preempted victim's full pages stay in the cache,
    held by it alone; the scheduler went on to preempt the next sequence (here the last one,
    leaving an empty step) instead of evicting them."""
    pool = PagePool(4, PAGE_SIZE)
    sched = Scheduler(SchedulerConfig(admission_watermark=0.0), pool, PrefixCache(pool))
    old = Sequence("old", [1, 2, 3, 4], SamplingParams(max_tokens=8), tenant="acme")
    young = Sequence("young", list(range(11, 23)), SamplingParams(max_tokens=8), tenant="acme")
    sched.add(old)
    sched.add(young)
    for item in sched.schedule().scheduled:  # both prefill: 4 full pages, all cached
        item.seq.num_computed_tokens += item.num_tokens
        sched.cache_full_pages(item.seq)
        item.seq.output_token_ids.append(next_token(item.seq.token_ids))
    assert pool.num_free_pages == 0
    out = sched.schedule()  # old needs a second page
    assert out.preempted == [young]
    assert [(item.seq, item.num_tokens) for item in out.scheduled] == [(old, 1)]


# -- the same machine against deliberately broken components -------------------------------


class SaltlessPrefixCache(PrefixCache):
    """Forgets the tenant's salt: one tenant's prompt hits another tenant's pages."""

    def page_keys(self, salt: str, token_ids: list[int], num_pages: int,
                  known: list[bytes] | None = None,
                  shared: tuple[str, int] | None = None) -> list[bytes]:
        return super().page_keys("", token_ids, num_pages, known, shared)


class LeakyScheduler(Scheduler):
    """Forgets to release the newest page of every sequence it frees."""

    def free_pages(self, seq: Sequence) -> None:
        if seq.recorded_pages:
            seq.recorded_pages.pop()
        super().free_pages(seq)


class QuotaBlindScheduler(Scheduler):
    """Never checks the tenant quota."""

    def _over_quota(self, tenant: str, more_pages: int) -> bool:
        return False


class TagReusingPool(PagePool):
    """Hands a reused page out again under its previous tag."""

    def allocate(self, owner: str) -> PageRef:
        ref = super().allocate(owner)
        if ref.tag > 1:
            self.tags[ref.page_id] -= 1
            ref = PageRef(ref.page_id, ref.tag - 1, ref.owner)
        return ref


BROKEN = {
    "saltless_cache": ({"cache_cls": SaltlessPrefixCache}, "crosses tenants"),
    "leaky_scheduler": ({"scheduler_cls": LeakyScheduler}, "holders"),
    "quota_blind_scheduler": ({"scheduler_cls": QuotaBlindScheduler}, "over its quota"),
    "tag_reusing_pool": ({"pool_cls": TagReusingPool}, "newer tag"),
}


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_the_machine_catches_a_broken_component(bug):
    overrides, message = BROKEN[bug]
    machine = type(f"Broken{bug.title().replace('_', '')}Machine", (KVMachine,), overrides)
    with pytest.raises(AssertionError, match=message):
        run_machine(machine, max_examples=200, derandomize=True, database=None,
                    phases=[Phase.generate], print_blob=False)
