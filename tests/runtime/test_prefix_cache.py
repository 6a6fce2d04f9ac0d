"""Prefix cache: hash-chained full pages, salted per tenant, shared by refcount, LRU-evicted."""

from __future__ import annotations

import pytest

from runtime.kv.pages import PagePool
from runtime.kv.prefix import PrefixCache
from runtime.sampling_params import SamplingParams


def cached_pool(num_pages=8, page_size=4):
    pool = PagePool(num_pages, page_size)
    return pool, PrefixCache(pool)


def fill(pool, cache, salt, tokens):
    """Allocate and index the full pages of `tokens` as a finished request would leave them."""
    keys = cache.page_keys(salt, tokens, len(tokens) // pool.page_size)
    refs = [pool.allocate(salt) for _ in keys]
    for key, ref in zip(keys, refs, strict=True):
        cache.insert(key, ref)
        pool.release(ref)  # the request finished; the cache keeps its own hold
    return keys, refs


def test_same_tokens_and_salt_give_the_same_chain_and_a_full_hit():
    pool, cache = cached_pool()
    keys, refs = fill(pool, cache, "acme", list(range(12)))
    assert cache.page_keys("acme", list(range(12)), 3) == keys
    assert cache.lookup(keys) == refs


def test_another_tenants_salt_never_hits():
    pool, cache = cached_pool()
    fill(pool, cache, "acme", list(range(12)))
    assert cache.lookup(cache.page_keys("globex", list(range(12)), 3)) == []


def test_a_page_key_depends_on_every_earlier_page():
    _pool, cache = cached_pool()
    a = cache.page_keys("acme", [1, 2, 3, 4, 5, 6, 7, 8], 2)
    b = cache.page_keys("acme", [9, 2, 3, 4, 5, 6, 7, 8], 2)
    assert a[1] != b[1]


def test_hit_stops_at_the_first_missing_page():
    pool, cache = cached_pool()
    _keys, refs = fill(pool, cache, "acme", list(range(8)))
    longer = cache.page_keys("acme", [*list(range(8)), 99, 98, 97, 96], 3)
    assert cache.lookup(longer) == refs


def test_cache_holds_exactly_one_reference_per_page():
    pool, cache = cached_pool()
    _, refs = fill(pool, cache, "acme", list(range(8)))
    assert [pool.refcounts[r.page_id] for r in refs] == [1, 1]
    cache.check_quiescent()


def test_eviction_frees_least_recently_used_pages_only_the_cache_holds():
    pool, cache = cached_pool(num_pages=4)
    old_keys, old = fill(pool, cache, "acme", [1, 1, 1, 1])
    new_keys, new = fill(pool, cache, "acme", [2, 2, 2, 2])
    pool.share(new[0])  # a running request uses the newer page
    cache.lookup(old_keys)  # ...and the old one was just hit, so it is the most recent
    assert cache.evict(2) == 1  # the shared page is not evictable
    assert cache.lookup(new_keys) == new and cache.lookup(old_keys) == []
    assert pool.refcounts[old[0].page_id] == 0
    pool.release(new[0])


def test_evict_spares_pages_about_to_be_shared():
    pool, cache = cached_pool(num_pages=2)
    keys, refs = fill(pool, cache, "acme", [1, 1, 1, 1])
    assert cache.evict(1, keep={refs[0].page_id}) == 0
    assert cache.lookup(keys) == refs


def test_discard_page_removes_it_for_good():
    pool, cache = cached_pool()
    keys, refs = fill(pool, cache, "acme", [5, 5, 5, 5])
    cache.discard_page(refs[0].page_id)
    assert cache.lookup(keys) == []
    pool.check_quiescent()


# -- with the real model --------------------------------------------------------------------

LONG_PROMPT = ("You are a careful assistant for a shipping company. " * 12
               + "Summarise the delivery policy in one sentence:")
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_same_prompt_twice_from_one_tenant_hits_every_full_page(engine, llm):
    engine.prefix_cache.clear()
    first = llm.generate([LONG_PROMPT], PARAMS, tenant="acme")[0]
    second = llm.generate([LONG_PROMPT], PARAMS, tenant="acme")[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (n - 1) // engine.pool.page_size * engine.pool.page_size
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.slow
def test_another_tenant_gets_no_hit_and_recomputes_the_whole_prompt(engine, llm):
    engine.prefix_cache.clear()
    a = llm.generate([LONG_PROMPT], PARAMS, tenant="acme")[0]
    lookups, hits = engine.prefix_cache.lookups, engine.prefix_cache.hits
    b = llm.generate([LONG_PROMPT], PARAMS, tenant="globex")[0]
    assert b.num_cached_tokens == 0
    assert engine.prefix_cache.lookups == lookups + 1 and engine.prefix_cache.hits == hits
    assert b.outputs[0].token_ids == a.outputs[0].token_ids


@pytest.mark.slow
def test_a_declared_shared_prefix_is_shared_only_within_its_namespace(engine, llm):
    engine.prefix_cache.clear()
    system = LONG_PROMPT + "\n"
    shared_tokens = engine.declare_shared_prefix("support-bot", system, ["acme", "globex"])
    question = (" Is weekend delivery possible, and what does it cost? I live in a small town "
                "far from the nearest depot, and I usually order heavy furniture twice a year.")
    try:
        a = llm.generate([system + question], PARAMS, tenant="acme")[0]
        b = llm.generate([system + question], PARAMS, tenant="globex")[0]
        c = llm.generate([system + question], PARAMS, tenant="initech")[0]
        a2 = llm.generate([system + question], PARAMS, tenant="acme")[0]
    finally:
        engine.shared_prefixes.clear()
    assert shared_tokens > 0
    assert a.num_cached_tokens == 0
    # globex hits the namespace's pages, but not acme's private pages after them
    assert b.num_cached_tokens == shared_tokens
    assert c.num_cached_tokens == 0  # not in the namespace
    assert a2.num_cached_tokens > shared_tokens  # acme's own continuation is cached for acme
    for out in (b, c, a2):
        assert out.outputs[0].token_ids == a.outputs[0].token_ids


def test_shared_keys_cover_only_the_shared_pages():
    _, cache = cached_pool()
    tokens = list(range(16))
    a = cache.page_keys("acme", tokens, 4, shared=("ns", 2))
    b = cache.page_keys("globex", tokens, 4, shared=("ns", 2))
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert cache.page_keys("acme", tokens, 2) != a[:2]  # namespace keys differ from a tenant's
