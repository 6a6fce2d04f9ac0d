"""Continuous batching with chunked prefill, page-gated admission and preemption by recompute.

Torch-free. Each step gets a token budget: running sequences go first (decodes cost one token,
unfinished prefills a chunk), oldest first; when a sequence needs a page and none is free, the
youngest running sequence is preempted (its pages freed, its tokens recomputed later). Waiting
sequences are admitted, oldest first, only when their first chunk's pages are free and no
preemption happened this step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.kv.pages import PagePool, PageRef
from runtime.kv.prefix import PrefixCache
from runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Fraction of the pool kept free when admitting, so running decodes rarely preempt.
    admission_watermark: float = 0.01
    # Largest fraction of the pool one tenant's running sequences may hold.
    tenant_page_quota: float = 1.0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(f"admission_watermark must be in [0, 1): {self.admission_watermark}")
        if not 0.0 < self.tenant_page_quota <= 1.0:
            raise ValueError(f"tenant_page_quota must be in (0, 1]: {self.tenant_page_quota}")


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # fed this step: token_ids[num_computed : num_computed + num_tokens]

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token (its last uncomputed token)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Page refs found stale at release (someone else holds the page now): not released.
        self.num_stale_releases = 0

    @property
    def quota_pages(self) -> int:
        return max(1, int(self.config.tenant_page_quota * self.pool.num_pages))

    def tenant_pages(self, tenant: str) -> int:
        """Pages held by the tenant's running sequences (cache-only holds are not charged)."""
        return sum(len(s.recorded_pages) for s in self.running if s.tenant == tenant)

    def _over_quota(self, tenant: str, more_pages: int) -> bool:
        if self.config.tenant_page_quota >= 1.0:
            return False  # the pool itself is the only limit
        return self.tenant_pages(tenant) + more_pages > self.quota_pages

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # Oldest first; preemption takes from the young end.
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve_pages(seq, num_tokens, scheduled_ids, out):
                # seq preempted itself; running[i] is now the next younger sequence, if any
                # (none after a pool preemption; another tenant's after a quota preemption).
                continue
            out.scheduled.append(ScheduledSequence(seq, num_tokens))
            scheduled_ids.add(id(seq))
            budget -= num_tokens
            i += 1
        if not out.preempted:
            budget = self._admit(budget, out)
        return out

    def _reserve_pages(self, seq: Sequence, num_tokens: int, scheduled_ids: set[int],
                       out: SchedulerOutput) -> bool:
        need = self.pool.pages_for_tokens(seq.num_computed_tokens + num_tokens)
        need -= len(seq.page_table)
        while need > 0 and self._over_quota(seq.tenant, need):
            # Over its quota, a tenant gives up its own youngest sequence, never another's.
            victim = next(s for s in reversed(self.running) if s.tenant == seq.tenant)
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > self.pool.num_free_pages and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.pool.num_free_pages)
        while need > 0 and not self.pool.can_allocate(need):
            victim = self.running[-1]
            if id(victim) in scheduled_ids:
                raise AssertionError("preempting a sequence already scheduled this step")
            self._preempt(victim, out)
            if victim is seq:
                return False
            if need > self.pool.num_free_pages and self.prefix_cache is not None:
                # The victim's cached pages are now held by the cache alone: evicting them
                # beats preempting another sequence.
                self.prefix_cache.evict(need - self.pool.num_free_pages)
        for _ in range(max(need, 0)):
            self._give_page(seq)
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        reserve = int(self.pool.num_pages * self.config.admission_watermark)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hits = self._cache_hits(seq)
            computed = seq.num_computed_tokens + len(hits) * self.pool.page_size
            num_tokens = min(seq.num_tokens - computed, budget)
            need = self.pool.pages_for_tokens(computed + num_tokens)
            need -= len(seq.page_table) + len(hits)
            # A lone sequence may use the reserve: otherwise it could never start.
            floor = reserve if self.running else 0
            if self._over_quota(seq.tenant, len(hits) + need):
                continue  # this tenant waits; other tenants may still be admitted
            short = need + floor - self.pool.num_free_pages
            if short > 0 and self.prefix_cache is not None:
                self.prefix_cache.evict(short, keep={r.page_id for r in hits})
            if self.pool.num_free_pages - need < floor:
                break
            self.waiting.remove(seq)
            self._take_hits(seq, hits)
            for _ in range(need):
                self._give_page(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.free_pages(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _cache_hits(self, seq: Sequence) -> list[PageRef]:
        if self.prefix_cache is None or seq.page_table or not seq.reuse_prefix:
            return []
        # Leave at least one token to compute: the step must produce the next token's logits.
        max_pages = (seq.num_tokens - 1) // self.pool.page_size
        seq.page_keys = self.prefix_cache.page_keys(seq.tenant, seq.token_ids, max_pages,
                                                    seq.page_keys[:max_pages], seq.shared_prefix)
        return self.prefix_cache.lookup(seq.page_keys)

    def _take_hits(self, seq: Sequence, hits: list[PageRef]) -> None:
        for ref in hits:
            # A stale ref is recorded as is: the integrity check aborts the sequence before
            # it reads the page (fail closed), and it is never released on its behalf.
            if self.pool.is_live(ref):
                self.pool.share(ref)
            seq.page_table.append(ref)
            seq.recorded_pages.append(ref)
        seq.num_computed_tokens += len(hits) * self.pool.page_size
        seq.num_pages_cached = len(hits)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = len(hits) * self.pool.page_size

    def postprocess(self, batch: SchedulerOutput, finished: list[Sequence]) -> None:
        """After the forward pass: every scheduled sequence's new tokens have KV (full pages go
        to the prefix cache), then the sequences that finished release their pages."""
        for item in batch.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.cache_full_pages(item.seq)
        for seq in finished:
            self.finish(seq)

    def cache_full_pages(self, seq: Sequence) -> None:
        """After a step: index the sequence's newly completed pages in the prefix cache."""
        if self.prefix_cache is None:
            return
        full = seq.num_computed_tokens // self.pool.page_size
        if full <= seq.num_pages_cached:
            return
        seq.page_keys = self.prefix_cache.page_keys(seq.tenant, seq.token_ids, full,
                                                    seq.page_keys[:full], seq.shared_prefix)
        for i in range(seq.num_pages_cached, full):
            self.prefix_cache.insert(seq.page_keys[i], seq.recorded_pages[i])
        seq.num_pages_cached = full

    def uncache_pages(self, seq: Sequence) -> None:
        """A sequence failed its integrity check: none of its pages may be served again."""
        if self.prefix_cache is not None:
            for ref in seq.recorded_pages:
                self.prefix_cache.discard_page(ref.page_id)

    def _give_page(self, seq: Sequence) -> None:
        ref = self.pool.allocate(seq.owner_of_page(len(seq.recorded_pages)))
        seq.page_table.append(ref)
        seq.recorded_pages.append(ref)

    def free_pages(self, seq: Sequence) -> None:
        # Release what the sequence recorded, newest first so the most recently written pages
        # are reused last. A ref that is no longer live belongs to someone else now: releasing
        # it would free their page.
        for ref in reversed(seq.recorded_pages):
            if self.pool.is_live(ref):
                self.pool.release(ref)
            else:
                self.num_stale_releases += 1
        seq.recorded_pages.clear()
        seq.page_table.clear()
        seq.num_pages_cached = 0

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is (running or waiting) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not (seq.export_kv and seq.finish_reason == "length"):
            self.free_pages(seq)
        seq.status = SequenceStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
