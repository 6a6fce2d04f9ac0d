"""Injected page faults end only the victim, fail-closed, before any token from a bad page.

Each fault is injected between two steps of a real batch on the real model. With the `tags`
tracker the victim ends with KV_INTEGRITY_VIOLATION and every other request's tokens equal a
fault-free run; with the tracker `off` the same fault corrupts the victim's output or leaks a
page, which proves the check is what catches it.
"""

from __future__ import annotations

import pytest

from runtime.errors import KVIntegrityViolation
from runtime.faults import FaultInjector
from runtime.integrity import NoopIntegrityTracker
from runtime.kv.pages import PageRef
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = {
    "victim": "The history of the Roman empire begins with a small city on the Tiber, which "
              "grew over centuries from a cluster of hilltop villages into the capital of a",
    "bystander": "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "thief": "Photosynthesis is the process by which green plants",
}
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
STEPS_BEFORE_FAULT = 6


@pytest.fixture(scope="module")
def baseline(llm):
    outs = llm.generate(list(PROMPTS.values()), PARAMS)
    return {name: o.outputs[0].token_ids for name, o in zip(PROMPTS, outs, strict=True)}


def run_with_fault(engine, inject, tenants=None):
    """Start all three, step, inject, run to the end. Returns final outputs and the victim's
    token count at the moment of the fault."""
    tenants = tenants or {}
    for name, prompt in PROMPTS.items():
        engine.add_request(name, prompt, PARAMS, tenant=tenants.get(name, "acme"))
    finals = {}
    for _ in range(STEPS_BEFORE_FAULT):
        for out in engine.step():
            assert not out.finished
    emitted_before = len(engine.requests["victim"].output_token_ids)
    inject(FaultInjector(engine))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals, emitted_before


FAULTS = {
    "use_after_free": lambda f: f.reassign_page("victim", "thief", index=0),
    "tag_bump": lambda f: f.bump_tag("victim", index=-1),
    "swapped_entries": lambda f: f.swap_entries("victim", 0, -1),
    "freed_while_writing": lambda f: f.free_early("victim", index=0),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_aborts_only_the_victim_before_it_reads_the_bad_page(engine, baseline, fault):
    checks_before = engine.tracker.counters.checks_run
    finals, emitted_before = run_with_fault(engine, FAULTS[fault])
    victim = finals["victim"]
    assert isinstance(victim.error, KVIntegrityViolation)
    assert victim.error.reason == "KV_INTEGRITY_VIOLATION"
    assert {"page_id", "expected_tag", "found_tag", "cause"} <= set(victim.error.metadata)
    assert victim.outputs[0].finish_reason == "error"
    # Nothing computed after the fault came out, and what came before was right.
    assert victim.outputs[0].token_ids == baseline["victim"][:emitted_before]
    for name in ("bystander", "thief"):
        assert finals[name].error is None
        assert finals[name].outputs[0].token_ids == baseline[name]
    assert engine.tracker.counters.checks_run > checks_before
    assert engine.tracker.counters.num_mismatches >= 1
    if fault == "tag_bump":
        # Nobody can tell whose hold the bumped page is: it is never released, only counted.
        repair_quarantined_page(engine)


def repair_quarantined_page(engine):
    pool = engine.pool
    cached = {r.page_id for r in engine.prefix_cache._index.values()}
    held = [p for p in range(pool.num_pages) if pool.refcounts[p] and p not in cached]
    assert len(held) == 1 and engine.scheduler.num_stale_releases >= 1
    while pool.refcounts[held[0]]:  # so later tests start clean
        pool.release(PageRef(held[0], pool.tags[held[0]]))


def test_a_page_of_another_tenant_is_caught_as_foreign_or_stale(engine, baseline):
    finals, _ = run_with_fault(engine, FAULTS["use_after_free"],
                               tenants={"victim": "acme", "thief": "globex"})
    assert finals["victim"].error.metadata["cause"] in ("stale_tag", "foreign_owner")
    assert finals["thief"].outputs[0].token_ids == baseline["thief"]


@pytest.fixture
def tracker_off(engine):
    saved = engine.tracker
    engine.tracker = NoopIntegrityTracker(engine.pool)
    yield engine
    engine.tracker = saved
    engine.prefix_cache.clear()  # without the check, corrupted pages may have been cached


@pytest.mark.parametrize("fault", ["use_after_free", "swapped_entries", "freed_while_writing"])
def test_without_the_check_the_same_fault_corrupts_the_victim(tracker_off, baseline, fault):
    finals, _ = run_with_fault(tracker_off, FAULTS[fault])
    assert finals["victim"].error is None
    assert finals["victim"].outputs[0].token_ids != baseline["victim"]


def test_without_the_check_a_tag_bump_leaks_the_page(tracker_off, baseline):
    finals, _ = run_with_fault(tracker_off, FAULTS["tag_bump"])
    assert finals["victim"].error is None  # it kept reading a page of another generation
    repair_quarantined_page(tracker_off)


def test_integrity_config_rejects_unknown_tracker():
    from runtime.config import EngineConfig
    from runtime.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="integrity"):
        EngineConfig(integrity="maybe")


def resurrect_then_rerun(engine, llm):
    """The victim's prompt is cached, its first page's entry goes stale, then it comes again."""
    victim = PROMPTS["victim"]
    llm.generate([victim], PARAMS, tenant="acme")
    key = engine.prefix_cache.page_keys("acme", llm.tokenizer.encode(victim), 1)[0]
    FaultInjector(engine).resurrect_cache_entry(key)
    return llm.generate(list(PROMPTS.values()), PARAMS, tenant="acme")


def test_a_resurrected_stale_cache_entry_aborts_the_request_that_hits_it(engine, llm, baseline):
    outs = dict(zip(PROMPTS, resurrect_then_rerun(engine, llm), strict=True))
    assert isinstance(outs["victim"].error, KVIntegrityViolation)
    assert outs["victim"].error.metadata["cause"] in ("stale_tag", "freed_page")
    assert outs["victim"].outputs[0].token_ids == []
    for name in ("bystander", "thief"):
        assert outs[name].outputs[0].token_ids == baseline[name]


def test_without_the_check_a_resurrected_entry_feeds_another_requests_kv(tracker_off, llm,
                                                                          baseline):
    outs = dict(zip(PROMPTS, resurrect_then_rerun(tracker_off, llm), strict=True))
    assert outs["victim"].error is None
    assert outs["victim"].outputs[0].token_ids != baseline["victim"]
