"""The scheduler, driven the way the engine drives it, with no model and no torch.

`engine_step` below is the engine's step loop minus the model: schedule, note which items
sample, advance `num_computed_tokens`, append a fake token to the samplers, finish on length.
"""

from __future__ import annotations

import itertools
import random

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

from runtime.kv.pages import PagePool
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.sequence import Sequence, SequenceStatus
from tests.helpers import engine_step

_token_ids = itertools.count(1000)
_request_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 16, tenant: str = "default") -> Sequence:
    return Sequence(f"req-{next(_request_ids)}", list(range(1, prompt_len + 1)),
                    SamplingParams(max_tokens=max_tokens), tenant=tenant)


def make_scheduler(num_pages: int, page_size: int = 4, *, max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 512, watermark: float = 0.0,
                   scheduler_cls: type[Scheduler] = Scheduler) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             admission_watermark=watermark)
    return scheduler_cls(config, PagePool(num_pages, page_size))




def scheduled_tokens(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_tokens) for item in out.scheduled]


def check_accounting(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Every held page is in exactly one page table, live, and owned by that table's tenant."""
    pool = sched.pool
    table_of: dict[int, Sequence] = {}
    for seq in seqs:
        if seq.is_finished:
            assert seq.page_table == [], f"{seq.request_id} finished but holds pages"
        for ref in seq.page_table:
            assert pool.is_live(ref), f"{seq.request_id} holds a dead page {ref}"
            assert pool.owners[ref.page_id] == seq.tenant
            assert pool.refcounts[ref.page_id] == 1
            assert ref.page_id not in table_of, f"page {ref.page_id} is in two page tables"
            table_of[ref.page_id] = seq
    assert len(table_of) == pool.num_used_pages, "a page is held by no page table (leak)"

    running, waiting = list(sched.running), list(sched.waiting)
    assert len({id(s) for s in running + waiting}) == len(running) + len(waiting)
    assert {id(s) for s in running + waiting} == {id(s) for s in seqs if not s.is_finished}
    assert len(running) <= sched.config.max_num_seqs
    for seq in running:
        assert seq.status is SequenceStatus.RUNNING
        assert 0 < seq.num_computed_tokens < seq.num_tokens
        assert len(seq.page_table) == pool.pages_for_tokens(seq.num_computed_tokens)
    for seq in waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.num_computed_tokens == 0
        assert seq.page_table == []


def checked_step(sched: Scheduler, seqs: list[Sequence],
                 stop: set[Sequence] | None = None) -> SchedulerOutput:
    """`engine_step` plus the per-step promises the scheduler makes about its output."""
    was_running = {id(s) for s in sched.running}
    had_work = sched.num_unfinished > 0
    out = engine_step(sched, stop)
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert not had_work or not out.is_empty, "scheduler made no progress with work pending"
    assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled)
    assert all(item.num_tokens >= 1 for item in out.scheduled)
    # Running sequences come first; admitted ones after; none admitted in a preempting step.
    flags = [id(item.seq) in was_running for item in out.scheduled]
    assert flags == sorted(flags, reverse=True)
    if out.preempted:
        assert all(flags)
        front = list(sched.waiting)[: len(out.preempted)]
        assert front == sorted(out.preempted, key=lambda s: s.arrival)
    # The youngest go first: everything preempted is younger than everything kept.
    kept = [item.seq.arrival for item in out.scheduled]
    assert all(p.arrival > a for p in out.preempted for a in kept)
    assert not {id(s) for s in out.preempted} & {id(i.seq) for i in out.scheduled}
    check_accounting(sched, seqs)
    return out


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": 0},
    {"max_num_batched_tokens": 0},
    {"admission_watermark": -0.1},
    {"admission_watermark": 1.0},
])
def test_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


# -- admission and prefill ----------------------------------------------------------------------


def test_a_new_sequence_gets_pages_for_its_whole_prompt_and_samples():
    sched = make_scheduler(num_pages=8)
    seq = make_seq(prompt_len=6, tenant="tenant-a")
    sched.add(seq)
    assert seq.status is SequenceStatus.WAITING
    out = sched.schedule()
    assert scheduled_tokens(out) == [(seq.request_id, 6)]
    assert out.scheduled[0].samples
    assert seq.status is SequenceStatus.RUNNING
    assert sched.running == [seq] and not sched.waiting
    assert len(seq.page_table) == 2
    assert all(sched.pool.owners[r.page_id] == "tenant-a" for r in seq.page_table)
    assert sched.pool.num_used_pages == 2


def test_an_empty_scheduler_returns_an_empty_batch():
    sched = make_scheduler(num_pages=4)
    out = sched.schedule()
    assert out.is_empty and out.num_tokens == 0 and not out.preempted


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(num_pages=16)
    old = make_seq(prompt_len=5)
    sched.add(old)
    engine_step(sched)
    new = make_seq(prompt_len=7)
    sched.add(new)
    out = sched.schedule()
    assert scheduled_tokens(out) == [(old.request_id, 1), (new.request_id, 7)]


def test_a_decode_gets_its_token_even_when_the_budget_is_nearly_spent_by_waiting_prefills():
    sched = make_scheduler(num_pages=16, max_num_batched_tokens=8)
    old = make_seq(prompt_len=8)
    sched.add(old)
    engine_step(sched)
    waiting = [make_seq(prompt_len=8) for _ in range(3)]
    for seq in waiting:
        sched.add(seq)
    out = sched.schedule()
    assert scheduled_tokens(out) == [(old.request_id, 1), (waiting[0].request_id, 7)]
    assert list(sched.waiting) == waiting[1:]


def test_a_decode_step_produces_a_sample_and_moves_one_token():
    sched = make_scheduler(num_pages=8)
    seq = make_seq(prompt_len=3)
    sched.add(seq)
    engine_step(sched)
    assert seq.num_computed_tokens == 3 and len(seq.output_token_ids) == 1
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(seq.request_id, 1)]
    assert seq.num_computed_tokens == 4 and len(seq.output_token_ids) == 2


def test_chunked_prefill_respects_the_token_budget_and_continues_over_several_steps():
    sched = make_scheduler(num_pages=16, page_size=4, max_num_batched_tokens=5)
    seq = make_seq(prompt_len=13)
    sched.add(seq)
    chunks, samples = [], []
    while not seq.output_token_ids:
        computed = seq.num_computed_tokens
        out = sched.schedule()
        assert out.num_tokens <= 5
        ((item,),) = [out.scheduled]
        chunks.append(item.num_tokens)
        samples.append(item.samples)  # read before the advance below changes it
        # Pages cover exactly what will have KV after this step, not the whole prompt.
        assert len(seq.page_table) == sched.pool.pages_for_tokens(computed + item.num_tokens)
        seq.num_computed_tokens += item.num_tokens
        if samples[-1]:
            seq.output_token_ids.append(next(_token_ids))
    assert chunks == [5, 5, 3]
    assert samples == [False, False, True]
    assert seq.num_computed_tokens == 13


def test_a_running_prefill_keeps_its_place_ahead_of_waiting_prefills():
    sched = make_scheduler(num_pages=32, max_num_batched_tokens=6)
    first, second = make_seq(prompt_len=10), make_seq(prompt_len=10)
    sched.add(first)
    sched.add(second)
    assert scheduled_tokens(engine_step(sched)) == [(first.request_id, 6)]
    assert scheduled_tokens(engine_step(sched)) == [(first.request_id, 4), (second.request_id, 2)]
    assert scheduled_tokens(engine_step(sched)) == [(first.request_id, 1), (second.request_id, 5)]


def test_admission_waits_when_pages_are_short():
    sched = make_scheduler(num_pages=4, page_size=4)
    big = make_seq(prompt_len=12, max_tokens=2)  # 3 pages
    later = make_seq(prompt_len=8)  # needs 2 pages, only 1 free
    sched.add(big)
    sched.add(later)
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(big.request_id, 12)]
    assert list(sched.waiting) == [later]
    assert later.page_table == [] and later.status is SequenceStatus.WAITING
    assert sched.pool.num_free_pages == 1
    out = engine_step(sched)  # big decodes its last token and finishes, freeing its pages
    assert big.is_finished
    assert list(sched.waiting) == [later]
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(later.request_id, 8)]


def test_admission_is_first_come_first_served_even_if_a_later_sequence_would_fit():
    sched = make_scheduler(num_pages=4, page_size=4)
    running = make_seq(prompt_len=8)
    sched.add(running)
    engine_step(sched)
    blocked, small = make_seq(prompt_len=12), make_seq(prompt_len=2)
    sched.add(blocked)
    sched.add(small)
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(running.request_id, 1)]
    assert list(sched.waiting) == [blocked, small]


def test_admission_keeps_the_watermark_free_unless_nothing_is_running():
    sched = make_scheduler(num_pages=8, page_size=4, watermark=0.25)  # keeps 2 pages free
    first = make_seq(prompt_len=28)  # 7 pages: eats into the reserve, but runs alone
    sched.add(first)
    assert scheduled_tokens(engine_step(sched)) == [(first.request_id, 28)]
    sched.finish(first)
    a, b = make_seq(prompt_len=16), make_seq(prompt_len=12)  # 4 pages, then 3 of 4 left
    sched.add(a)
    sched.add(b)
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(a.request_id, 16)]
    assert list(sched.waiting) == [b]
    assert sched.pool.num_free_pages == 4


def test_max_num_seqs_is_respected():
    sched = make_scheduler(num_pages=64, max_num_seqs=3)
    seqs = [make_seq(prompt_len=4, max_tokens=3) for _ in range(5)]
    for seq in seqs:
        sched.add(seq)
    out = engine_step(sched)
    assert [item.seq for item in out.scheduled] == seqs[:3]
    assert len(sched.running) == 3 and list(sched.waiting) == seqs[3:]
    out = engine_step(sched)
    assert [item.seq for item in out.scheduled] == seqs[:3]
    sched.finish(seqs[1])
    out = engine_step(sched)
    assert [item.seq for item in out.scheduled] == [seqs[0], seqs[2], seqs[3]]
    assert len(sched.running) <= 3


# -- preemption ---------------------------------------------------------------------------------


def _three_full_pages() -> tuple[Scheduler, list[Sequence]]:
    """A 4-page pool holding three 1-page sequences that each need a second page next step."""
    sched = make_scheduler(num_pages=4, page_size=4)
    seqs = [make_seq(prompt_len=4) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    engine_step(sched)
    assert sched.pool.num_free_pages == 1
    return sched, seqs


def test_preemption_picks_the_youngest_running_sequence():
    sched, (a, b, c) = _three_full_pages()
    out = sched.schedule()
    assert out.preempted == [c]
    assert scheduled_tokens(out) == [(a.request_id, 1), (b.request_id, 1)]
    assert sched.running == [a, b]


def test_a_preempted_sequence_loses_its_pages_and_its_computed_tokens():
    sched, (a, b, c) = _three_full_pages()
    outputs = list(c.output_token_ids)
    sched.schedule()
    assert c.page_table == []
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == outputs  # recomputed later, not thrown away
    assert c.status is SequenceStatus.WAITING
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.pool.num_used_pages == len(a.page_table) + len(b.page_table) == 4


def test_a_preempted_sequence_goes_to_the_front_of_the_waiting_queue():
    sched, (_, _, c) = _three_full_pages()
    d = make_seq(prompt_len=4)
    sched.add(d)
    sched.schedule()
    assert list(sched.waiting) == [c, d]


def test_several_preempted_sequences_wait_oldest_first():
    sched = make_scheduler(num_pages=3, page_size=4)
    a, b, c = (make_seq(prompt_len=4) for _ in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    engine_step(sched)
    out = sched.schedule()
    # a takes c's page; b then needs one, and is the youngest left, so it goes itself.
    assert out.preempted == [c, b]
    assert scheduled_tokens(out) == [(a.request_id, 1)]
    assert list(sched.waiting) == [b, c]


def test_a_sequence_that_is_the_youngest_preempts_itself_rather_than_an_older_one():
    sched = make_scheduler(num_pages=2, page_size=4)
    old, young = make_seq(prompt_len=3), make_seq(prompt_len=4)
    sched.add(old)
    sched.add(young)
    engine_step(sched)
    old_pages = list(old.page_table)
    out = sched.schedule()  # old fits in its page; young needs a second page: none left
    assert out.preempted == [young]
    assert scheduled_tokens(out) == [(old.request_id, 1)]
    assert old.page_table == old_pages


def test_no_sequence_is_admitted_in_the_step_that_preempted():
    sched = make_scheduler(num_pages=4, page_size=2, max_num_batched_tokens=3)
    a, b = make_seq(prompt_len=2), make_seq(prompt_len=4)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        engine_step(sched)
    assert sched.pool.num_free_pages == 0
    out = engine_step(sched)
    assert out.preempted == [b]
    assert scheduled_tokens(out) == [(a.request_id, 1)]
    # b would fit now (one page for a 2-token chunk), but not in the step that evicted it.
    assert sched.pool.num_free_pages == 1 and list(sched.waiting) == [b]
    out = engine_step(sched)
    assert scheduled_tokens(out) == [(a.request_id, 1), (b.request_id, 2)]


def test_a_preempted_sequence_recomputes_its_prompt_and_outputs_when_readmitted():
    sched, (a, b, c) = _three_full_pages()
    sched.schedule()
    assert c.num_tokens == 5
    sched.finish(a)
    sched.finish(b)
    out = sched.schedule()
    assert scheduled_tokens(out) == [(c.request_id, 5)]
    assert out.scheduled[0].samples
    assert len(c.page_table) == 2


# -- finish and abort ---------------------------------------------------------------------------


def test_finishing_a_running_sequence_frees_its_pages():
    sched = make_scheduler(num_pages=8)
    seq = make_seq(prompt_len=9)
    sched.add(seq)
    engine_step(sched)
    refs = list(seq.page_table)
    sched.finish(seq)
    assert seq.is_finished and seq.page_table == []
    assert seq not in sched.running
    assert not any(sched.pool.is_live(r) for r in refs)
    sched.pool.check_quiescent()


def test_aborting_a_waiting_sequence_removes_it_from_the_queue():
    sched = make_scheduler(num_pages=8)
    seq = make_seq(prompt_len=4)
    sched.add(seq)
    sched.finish(seq)
    assert seq.is_finished and not sched.waiting and sched.num_unfinished == 0
    assert sched.schedule().is_empty
    sched.pool.check_quiescent()


def test_aborting_a_preempted_sequence_leaves_the_others_untouched():
    sched, (a, b, c) = _three_full_pages()
    sched.schedule()
    sched.finish(c)
    assert not sched.waiting and sched.running == [a, b]
    for seq in (a, b):
        sched.finish(seq)
    sched.pool.check_quiescent()


def test_finishing_twice_is_harmless():
    sched = make_scheduler(num_pages=8)
    seq = make_seq(prompt_len=4)
    sched.add(seq)
    engine_step(sched)
    sched.finish(seq)
    sched.finish(seq)
    sched.pool.check_quiescent()


def test_finishing_on_max_tokens_returns_every_page():
    sched = make_scheduler(num_pages=8, max_num_batched_tokens=4)
    seqs = [make_seq(prompt_len=n, max_tokens=m) for n, m in [(5, 3), (9, 1), (2, 6)]]
    for seq in seqs:
        sched.add(seq)
    for _ in range(100):
        if not sched.num_unfinished:
            break
        checked_step(sched, seqs)
    assert [len(s.output_token_ids) for s in seqs] == [3, 1, 6]
    sched.pool.check_quiescent()


def test_find_looks_in_running_and_waiting():
    sched = make_scheduler(num_pages=2, page_size=4)
    running, waiting = make_seq(prompt_len=8), make_seq(prompt_len=4)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert sched.find(running.request_id) is running
    assert sched.find(waiting.request_id) is waiting
    assert sched.find("nope") is None


def test_pages_carry_the_tenant_of_the_sequence_that_holds_them():
    sched = make_scheduler(num_pages=8)
    a, b = make_seq(prompt_len=8, tenant="tenant-a"), make_seq(prompt_len=5, tenant="tenant-b")
    sched.add(a)
    sched.add(b)
    engine_step(sched)
    assert {sched.pool.owners[r.page_id] for r in a.page_table} == {"tenant-a"}
    assert {sched.pool.owners[r.page_id] for r in b.page_table} == {"tenant-b"}


# -- randomized: the engine loop with random arrivals, stops, aborts and a small pool -----------

TENANTS = ["tenant-a", "tenant-b", "tenant-c"]


def _random_seq(rng: random.Random, sched: Scheduler) -> Sequence:
    capacity = sched.pool.num_pages * sched.pool.page_size
    # NOTE: prompt + outputs always fit the pool alone (the engine's max_model_len guarantees it).
    prompt_len = rng.randint(1, capacity - 1)
    max_tokens = rng.randint(1, min(12, capacity - prompt_len))
    return make_seq(prompt_len, max_tokens, tenant=rng.choice(TENANTS))


def drive_randomly(seed: int, scheduler_cls: type[Scheduler] = Scheduler) -> Scheduler:
    rng = random.Random(seed)
    sched = make_scheduler(num_pages=rng.randint(8, 24), page_size=4,
                           max_num_seqs=rng.randint(1, 8),
                           max_num_batched_tokens=rng.choice([2, 3, 8, 16, 64]),
                           watermark=rng.choice([0.0, 0.1, 0.25]), scheduler_cls=scheduler_cls)
    seqs: list[Sequence] = []
    for step in range(120):
        if step < 60 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 2)):
                seqs.append(_random_seq(rng, sched))
                sched.add(seqs[-1])
        if sched.num_unfinished and rng.random() < 0.05:
            sched.finish(rng.choice(list(sched.running) + list(sched.waiting)))  # abort
            check_accounting(sched, seqs)
        stop = {s for s in sched.running if rng.random() < 0.05}
        checked_step(sched, seqs, stop)
        if step >= 60 and not sched.num_unfinished:
            break
    for _ in range(20_000):
        if not sched.num_unfinished:
            break
        checked_step(sched, seqs)
    assert all(s.is_finished for s in seqs)
    sched.pool.check_quiescent()
    return sched


def test_random_engine_loops_keep_every_page_accounted_for():
    preemptions = 0
    for seed in range(30):
        preemptions += drive_randomly(seed).num_preemptions
    assert preemptions > 0, "the randomized runs never exercised preemption"


class LeakyScheduler(Scheduler):
    """Forgets one page whenever it frees a sequence: the bug the checks above must catch."""

    def free_pages(self, seq: Sequence) -> None:
        if seq.recorded_pages:
            seq.recorded_pages.pop()
        super().free_pages(seq)


def test_the_randomized_checks_catch_a_leaked_page():
    with pytest.raises(AssertionError, match="leak"):
        drive_randomly(0, scheduler_cls=LeakyScheduler)


class SchedulerMachine(RuleBasedStateMachine):
    """Hypothesis drives the engine loop: adds, steps with random stops, aborts."""

    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.seqs: list[Sequence] = []

    @initialize(num_pages=st.integers(8, 24), max_num_seqs=st.integers(1, 8),
                budget=st.sampled_from([1, 2, 5, 8, 16, 64]),
                watermark=st.sampled_from([0.0, 0.1, 0.25]))
    def start(self, num_pages: int, max_num_seqs: int, budget: int, watermark: float) -> None:
        self.sched = make_scheduler(num_pages, 4, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=budget, watermark=watermark,
                                    scheduler_cls=self.scheduler_cls)

    @rule(data=st.data(), count=st.integers(1, 3))
    def add_sequences(self, data: st.DataObject, count: int) -> None:
        assert self.sched is not None
        capacity = self.sched.pool.num_pages * self.sched.pool.page_size
        for _ in range(count):
            # Mostly short prompts, so several sequences share the pool and grow into it.
            prompt_len = data.draw(st.one_of(st.integers(1, 12), st.integers(1, capacity - 1)),
                                   label="prompt_len")
            max_tokens = data.draw(st.integers(1, min(16, capacity - prompt_len)),
                                   label="max_tokens")
            seq = make_seq(prompt_len, max_tokens, tenant=data.draw(st.sampled_from(TENANTS)))
            self.seqs.append(seq)
            self.sched.add(seq)

    @rule(rng=st.randoms(use_true_random=False), count=st.integers(1, 8))
    def step(self, rng: random.Random, count: int) -> None:
        assert self.sched is not None
        for _ in range(count):
            stop = {s for s in self.sched.running if rng.random() < 0.05}
            checked_step(self.sched, self.seqs, stop)

    @precondition(lambda self: self.sched is not None and self.sched.num_unfinished > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.sched is not None
        unfinished = [s for s in self.seqs if not s.is_finished]
        self.sched.finish(data.draw(st.sampled_from(unfinished), label="abort"))

    @invariant()
    def pages_are_accounted_for(self) -> None:
        if self.sched is not None:
            check_accounting(self.sched, self.seqs)

    def teardown(self) -> None:
        if self.sched is None:
            return
        for _ in range(20_000):
            if not self.sched.num_unfinished:
                break
            checked_step(self.sched, self.seqs)
        assert all(s.is_finished for s in self.seqs)
        self.sched.pool.check_quiescent()


def test_hypothesis_driven_engine_loop_keeps_every_page_accounted_for():
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))



class LeakySchedulerMachine(SchedulerMachine):
    scheduler_cls = LeakyScheduler


def test_the_hypothesis_driven_checks_catch_a_leaked_page():
    with pytest.raises(AssertionError, match="leak"):
        run_state_machine_as_test(LeakySchedulerMachine, settings=settings(
            max_examples=60, stateful_step_count=30, deadline=None, database=None,
            phases=[Phase.generate], print_blob=False))
