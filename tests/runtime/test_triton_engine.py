"""The engine end to end on the `triton` attention backend, in Triton's interpreter on CPU, with
the real default model: greedy tokens equal the `torch` backend's for bf16 and int8 KV, through a
prefix-cache hit, a preempted and resumed sequence, and a planted tag mismatch that aborts
exactly its sequence (fail-closed, KV_INTEGRITY_VIOLATION) while the others' tokens are those of
a fault-free run.

One scenario per format, on a 4-page pool: `a` (17 tokens) and `b` (14) start; `c` (`a`'s first
page and more) arrives after the first step and hits `a`'s cached page; `b` needs a page on its
fourth step and the youngest, `c`, is preempted, to resume later from the cache; `a`'s last page
changes its tag before that step. The interpreter is slow (~0.3-1 s per layer and step), so the
scenario is short: 4 tokens each, 6 steps.
"""

from __future__ import annotations

import pytest

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from runtime import LLM, SamplingParams
from runtime.attention.triton_tags import DeviceTagIntegrityTracker
from runtime.errors import KVIntegrityViolation
from runtime.faults import FaultInjector

pytestmark = pytest.mark.slow

A = "The history of the Roman empire begins with a small city on the Tiber river in Italy"
B = "Photosynthesis is the process by which green plants turn light into chemical energy"
C = A + ", and then"
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
POOL_PAGES = 4
FAULT_BEFORE_STEP = 4  # b's first page miss and c's preemption come in this step


def _baseline(kv: str) -> tuple[dict[str, list[int]], int]:
    """Every prompt's tokens on the `torch` backend in a roomy pool (no preemption, no fault),
    and the format's bytes per page."""
    llm = LLM(kv_cache_bytes=64 << 20, max_num_seqs=4, kv_cache_dtype=kv,
              attention_backend="torch")
    outs = llm.generate([A, B, C], PARAMS)
    tokens = {name: o.outputs[0].token_ids for name, o in zip("abc", outs, strict=True)}
    return tokens, llm.engine.kv_cache.spec.bytes_per_page


def _scenario(kv: str, bytes_per_page: int) -> tuple[dict, dict[str, int]]:
    llm = LLM(kv_cache_bytes=POOL_PAGES * bytes_per_page, max_num_seqs=4, kv_cache_dtype=kv,
              attention_backend="triton")
    engine = llm.engine
    assert engine.pool.num_pages == POOL_PAGES
    assert isinstance(engine.tracker, DeviceTagIntegrityTracker)
    engine.add_request("a", A, PARAMS)
    engine.add_request("b", B, PARAMS)
    finals, seen = {}, {"a_tokens_at_fault": -1, "c_preemptions": 0}
    step = 0
    while engine.has_unfinished_requests():
        if step == 1:
            engine.add_request("c", C, PARAMS)
        if step == FAULT_BEFORE_STEP - 1:
            seen["a_tokens_at_fault"] = len(engine.requests["a"].output_token_ids)
            FaultInjector(engine).bump_tag("a", index=-1)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if "c" in engine.requests:
            seen["c_preemptions"] = engine.requests["c"].num_preemptions
        step += 1
    seen["mismatches"] = engine.tracker.counters.num_mismatches
    return finals, seen


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_triton_backend_gives_the_torch_tokens_through_hit_preemption_and_a_planted_mismatch(kv):
    want, bytes_per_page = _baseline(kv)
    finals, seen = _scenario(kv, bytes_per_page)
    a, b, c = finals["a"], finals["b"], finals["c"]
    # the planted mismatch: a ends fail-closed, with what it had emitted before the fault
    assert isinstance(a.error, KVIntegrityViolation), a.error
    assert a.error.reason == "KV_INTEGRITY_VIOLATION"
    assert a.error.metadata["cause"] == "stale_tag"
    assert a.outputs[0].finish_reason == "error"
    assert seen["a_tokens_at_fault"] > 0
    assert a.outputs[0].token_ids == want["a"][: seen["a_tokens_at_fault"]]
    assert seen["mismatches"] == 1
    # the others: the torch backend's tokens of a fault-free run without preemption
    assert b.error is None and b.outputs[0].token_ids == want["b"]
    assert c.error is None and c.outputs[0].token_ids == want["c"]
    assert c.num_cached_tokens >= 16, "c never hit a's cached page"
    assert seen["c_preemptions"] >= 1, "c was never preempted"
