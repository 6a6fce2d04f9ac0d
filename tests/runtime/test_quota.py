"""Per-tenant page quota: a tenant past its share of the pool waits or is refused, and the
other tenants proceed as if it were not there.

The scheduler tests drive it the way the engine does, with no model and no torch; the engine
tests use the real model in a small pool with a quota of a quarter.
"""

from __future__ import annotations

import itertools

import pytest

from runtime.errors import TenantQuotaExceeded
from runtime.kv.pages import PagePool
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.sequence import Sequence, SequenceStatus
from tests.helpers import engine_step as drive_step

_request_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int, tenant: str) -> Sequence:
    return Sequence(f"{tenant}-{next(_request_ids)}", list(range(1, prompt_len + 1)),
                    SamplingParams(max_tokens=max_tokens), tenant=tenant)


def make_scheduler(num_pages: int = 16, quota: float = 0.5, *,
                   max_num_batched_tokens: int = 512) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                             admission_watermark=0.0, tenant_page_quota=quota)
    return Scheduler(config, PagePool(num_pages, page_size=4))


def engine_step(sched: Scheduler) -> SchedulerOutput:
    """One model-free engine step; the quota holds after every step."""
    out = drive_step(sched)
    if sched.config.tenant_page_quota < 1.0:
        for tenant in {s.tenant for s in sched.running}:
            assert sched.tenant_pages(tenant) <= sched.quota_pages
    return out


def scheduled(out: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return [(item.seq, item.num_tokens) for item in out.scheduled]


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)


# -- the scheduler ------------------------------------------------------------------------------


def test_quota_is_a_share_of_the_pool_in_whole_pages():
    assert make_scheduler(16, 0.5).quota_pages == 8
    assert make_scheduler(22, 0.25).quota_pages == 5
    assert make_scheduler(3, 0.1).quota_pages == 1  # never zero: every tenant can run
    with pytest.raises(ValueError, match="tenant_page_quota"):
        SchedulerConfig(tenant_page_quota=0.0)


def test_a_tenant_at_its_quota_waits_while_another_tenant_is_admitted():
    sched = make_scheduler(16, 0.5)  # 8 pages each
    big = make_seq(prompt_len=28, max_tokens=4, tenant="acme")  # 7 pages, 8 at the end
    add(sched, big)
    engine_step(sched)
    more_a, b = make_seq(8, 2, "acme"), make_seq(8, 2, "globex")
    add(sched, more_a, b)  # acme's comes first in the queue
    out = engine_step(sched)
    assert scheduled(out) == [(big, 1), (b, 8)]
    assert list(sched.waiting) == [more_a] and more_a.page_table == []
    assert sched.tenant_pages("acme") == sched.quota_pages == 8
    # The pool could take it: only the quota holds it back.
    assert sched.pool.num_free_pages >= 2
    while not big.is_finished:
        engine_step(sched)
    for _ in range(4):
        engine_step(sched)
    assert more_a.is_finished and b.is_finished


def test_growth_past_quota_preempts_the_tenants_own_youngest_not_another_tenants():
    sched = make_scheduler(16, 0.5)
    a1, a2 = make_seq(16, 8, "acme"), make_seq(16, 8, "acme")  # 4 pages each: acme's 8
    b = make_seq(3, 8, "globex")  # the youngest of all; its decode fits its page
    add(sched, a1, a2, b)
    engine_step(sched)
    b_pages = list(b.page_table)
    out = sched.schedule()  # a1 needs a fifth page: acme would hold 9
    assert out.preempted == [a2]
    assert scheduled(out) == [(a1, 1), (b, 1)]
    assert b.page_table == b_pages and b.status is SequenceStatus.RUNNING
    assert a2.status is SequenceStatus.WAITING and a2.page_table == []
    assert sched.tenant_pages("acme") == 5
    assert sched.pool.num_free_pages == 16 - 5 - 1  # the pool was never short


def test_a_tenant_preempting_itself_does_not_hold_back_another_tenants_younger_sequence():
    sched = make_scheduler(16, 0.5)
    a1 = make_seq(15, 8, "acme")  # its first decode fits in its 4 pages
    a2 = make_seq(16, 8, "acme")  # its first decode needs a fifth: acme's youngest goes
    b = make_seq(4, 8, "globex")
    add(sched, a1, a2, b)
    engine_step(sched)
    out = sched.schedule()
    assert out.preempted == [a2]
    assert scheduled(out) == [(a1, 1), (b, 1)]


def test_quota_waits_do_not_block_other_tenants_queued_behind():
    sched = make_scheduler(16, 0.5)
    hogs = [make_seq(28, 4, "acme") for _ in range(3)]  # 7-8 pages each: one at a time
    others = [make_seq(4, 2, t) for t in ("globex", "initech")]
    add(sched, *hogs, *others)
    out = engine_step(sched)
    assert scheduled(out) == [(hogs[0], 28), (others[0], 4), (others[1], 4)]
    assert list(sched.waiting) == hogs[1:]


def run_long_request_against_short_ones(quota: float) -> tuple[int | None, Sequence,
                                                               list[Sequence]]:
    """acme sends one long request (64 tokens, a quarter of the pool) and a backlog of six
    more; globex sends eight short ones just after. Returns the step at which globex's last
    request finished, or None if acme's long request had finished before it."""
    sched = make_scheduler(32, quota, max_num_batched_tokens=16)
    long = make_seq(24, 40, "acme")
    backlog = [make_seq(20, 20, "acme") for _ in range(6)]
    shorts = [make_seq(6, 4, "globex") for _ in range(8)]
    add(sched, long, *backlog, *shorts)
    for step in range(1, 1000):
        engine_step(sched)
        if all(s.is_finished for s in shorts):
            return (None if long.is_finished else step), long, shorts
    raise AssertionError("the workload never finished")


def test_one_very_long_request_cannot_starve_another_tenant():
    done_at, long, shorts = run_long_request_against_short_ones(quota=0.5)
    assert done_at is not None, "globex waited for acme's long request to finish"
    # Eight requests of 10 tokens in globex's half of the pool, sharing a 16-token budget
    # with acme: a few steps each, not the long request's 40 decodes.
    assert done_at <= 20
    assert len(long.output_token_ids) < long.params.max_tokens // 2
    assert all(len(s.output_token_ids) == 4 for s in shorts)


def test_without_a_quota_the_same_workload_makes_the_other_tenant_wait_for_the_long_one():
    done_at, long, shorts = run_long_request_against_short_ones(quota=1.0)
    assert done_at is None and long.is_finished
    assert all(s.is_finished for s in shorts)


# -- the engine, with the real model ----------------------------------------------------------

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = {
    "acme": "The three primary colours are",
    "globex": "def add(a, b):\n    return",
}
ACME_LONGER = {  # two to three pages of 16 tokens each
    "acme-1": "Here is a short list of the three primary colours used in painting, with one "
              "sentence about each of them:",
    "acme-2": "Write a limerick about a cat who learned to program in Python and then refused "
              "to catch any mice at all:",
}


@pytest.fixture(scope="module")
def quota_engine():
    """The default model in a ~22-page pool of which a tenant may hold a quarter (5 pages)."""
    import torch

    from runtime import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core box: two spinning threads are far slower
    llm = LLM(kv_cache_bytes=16 << 20, tenant_page_quota=0.25)
    yield llm.engine
    torch.set_num_threads(threads)


@pytest.fixture
def engine(quota_engine):
    """This module's quota engine (not the session's), starting from a cold prefix cache;
    after each test no request may be left in flight and no page held."""
    quota_engine.prefix_cache.clear()
    yield quota_engine
    for rid in list(quota_engine.requests):
        quota_engine.abort_request(rid)
    quota_engine.check_quiescent()
    quota_engine.prefix_cache.clear()
    quota_engine.pool.check_quiescent()


def run_alone(engine, tenant: str, prompt: str, params: SamplingParams) -> list[int]:
    engine.add_request(f"alone-{next(_request_ids)}", prompt, params, tenant=tenant)
    final = run_to_end(engine)
    engine.prefix_cache.clear()  # the runs under test start from the same cold cache
    (out,) = final.values()
    return out.outputs[0].token_ids


def run_to_end(engine, max_steps: int = 500) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("requests never finished")


@pytest.mark.slow
def test_a_request_over_the_quota_is_refused_and_requests_in_flight_are_unaffected(engine):
    alone = {t: run_alone(engine, t, p, GREEDY) for t, p in PROMPTS.items()}
    for tenant, prompt in PROMPTS.items():
        engine.add_request(tenant, prompt, GREEDY, tenant=tenant)
    for _ in range(3):
        engine.step()
    quota_tokens = engine.scheduler.quota_pages * engine.pool.page_size
    too_long = SamplingParams(max_tokens=quota_tokens, temperature=0.0)
    with pytest.raises(TenantQuotaExceeded) as refused:
        engine.add_request("too-long", "Hello", too_long, tenant="acme")
    assert refused.value.reason == "TENANT_QUOTA_EXCEEDED"
    assert refused.value.metadata == {"tenant": "acme",
                                      "quota_pages": str(engine.scheduler.quota_pages)}
    assert "too-long" not in engine.requests and engine.scheduler.find("too-long") is None
    finals = run_to_end(engine)
    for tenant in PROMPTS:
        assert finals[tenant].error is None
        assert finals[tenant].outputs[0].token_ids == alone[tenant]
    engine.check_quiescent()


@pytest.mark.slow
def test_a_request_that_fits_the_quota_exactly_is_accepted(engine):
    quota_tokens = engine.scheduler.quota_pages * engine.pool.page_size
    prompt_len = len(engine.tokenizer.encode(PROMPTS["acme"]))
    params = SamplingParams(max_tokens=quota_tokens - prompt_len, temperature=0.0,
                            ignore_eos=True)
    engine.add_request("exact", PROMPTS["acme"], params, tenant="acme")
    finals = run_to_end(engine)
    assert finals["exact"].error is None
    assert len(finals["exact"].outputs[0].token_ids) == quota_tokens - prompt_len


@pytest.mark.slow
def test_a_tenant_at_its_quota_waits_while_another_tenant_proceeds(engine):
    # Each acme request ends at exactly 3 pages: two of them would need 6, over acme's 5.
    end_tokens = 3 * engine.pool.page_size
    alone = run_alone(engine, "globex", PROMPTS["globex"], GREEDY)
    for rid, prompt in ACME_LONGER.items():
        n = len(engine.tokenizer.encode(prompt))
        assert engine.pool.page_size < n <= 2 * engine.pool.page_size  # 2 pages to start
        engine.add_request(rid, prompt, SamplingParams(max_tokens=end_tokens - n,
                                                       temperature=0.0, ignore_eos=True),
                           tenant="acme")
    engine.add_request("globex", PROMPTS["globex"], GREEDY, tenant="globex")
    finals, acme_waited = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        sched = engine.scheduler
        assert sched.tenant_pages("acme") <= sched.quota_pages
        acme_waited |= (any(s.tenant == "acme" for s in sched.waiting)
                        and "globex" not in finals)
    assert acme_waited, "acme never had to wait for its quota while globex ran"
    assert finals["globex"].error is None
    assert finals["globex"].outputs[0].token_ids == alone
    for rid in ACME_LONGER:
        assert finals[rid].error is None and finals[rid].outputs[0].finish_reason == "length"
    engine.check_quiescent()


@pytest.mark.slow
def test_an_unset_max_tokens_is_limited_to_what_the_quota_holds_not_refused(engine):
    quota_tokens = engine.scheduler.quota_pages * engine.pool.page_size
    assert quota_tokens < engine.max_model_len
    prompt_len = len(engine.tokenizer.encode(PROMPTS["acme"]))
    seq = engine.add_request("unset", PROMPTS["acme"], SamplingParams(max_tokens=None),
                             tenant="acme")
    assert seq.max_tokens == quota_tokens - prompt_len
