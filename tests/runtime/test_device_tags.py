"""Device-resident tags on the `triton` backend (Triton's interpreter on CPU): the pool's tags,
owners and refcounts follow the pool on the device without a copy a step; a failed sequence's
flag is obeyed on the device (no KV written, the sampler's -1) and the engine learns of it from
the token copy it already makes, with no host read of its own.

Host syncs are counted by wrapping the tensor methods that read a tensor back (`tolist`,
`item`, `cpu`, `numpy`, `__int__`, `__float__`, `__bool__`) during a step. On CPU every tensor
is a host tensor, so the count is an upper bound of the GPU's syncs; the rare path that
explains an abort on the host (over the pool's host arrays, host tensors on any device) is
left out of the count.
"""

from __future__ import annotations

import pytest
import torch

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from runtime.attention.triton import masked_slots
from runtime.attention.triton_tags import DevicePoolState, DeviceTagIntegrityTracker
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.errors import KVIntegrityViolation
from runtime.faults import FaultInjector
from runtime.kv.pages import PagePool
from runtime.sampler import INVALID_TOKEN, Sampler
from runtime.sampling_params import SamplingParams
from tests.helpers import tiny_random_checkpoint

READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__")
PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = {"a": list(range(5, 25)), "b": list(range(30, 41)), "c": list(range(50, 53))}


class SyncCounter:
    """Counts host reads of tensors while `on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.on = 0, False
        for name in READS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def counted(t, *args, **kwargs):
            if self.on:
                self.count += 1
            return real(t, *args, **kwargs)
        return counted

    def step(self, engine: LLMEngine) -> tuple[list, int]:
        self.count, self.on = 0, True
        try:
            outs = engine.step()
        finally:
            self.on = False
        return outs, self.count


def _engine(integrity: str = "tags") -> LLMEngine:
    return LLMEngine(tiny_random_checkpoint(), EngineConfig(
        kv_cache_bytes=1 << 20, attention_backend="triton", integrity=integrity,
        enable_prefix_caching=False))


def _run(engine: LLMEngine, counter: SyncCounter, fault_at: int | None = None,
         ) -> tuple[dict[str, list[int]], dict[str, object], list[int]]:
    """All three prompts to the end; `fault_at`: before that step, b's last page's tag moves
    on. Returns each request's tokens, its error, and each step's host reads."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS)
    tokens: dict[str, list[int]] = {}
    errors: dict[str, object] = {}
    reads: list[int] = []
    step = 0
    while engine.has_unfinished_requests():
        if step == fault_at:
            FaultInjector(engine).bump_tag("b", index=-1)
        outs, n = counter.step(engine)
        reads.append(n)
        for out in outs:
            tokens[out.request_id] = out.outputs[0].token_ids
            errors[out.request_id] = out.error
        step += 1
    return tokens, errors, reads


@pytest.fixture
def counter(monkeypatch) -> SyncCounter:
    # the host's explanation of an abort (the rare path) reads host tensors: not counted
    explain = DeviceTagIntegrityTracker.explain

    def uncounted(self, seqs):
        on, c.on = c.on, False
        try:
            return explain(self, seqs)
        finally:
            c.on = on

    monkeypatch.setattr(DeviceTagIntegrityTracker, "explain", uncounted)
    c = SyncCounter(monkeypatch)
    return c


def test_a_planted_mismatch_aborts_exactly_its_sequence_from_the_token_copy(counter):
    clean_tokens, _, clean_reads = _run(_engine(), counter)
    off_tokens, _, off_reads = _run(_engine("off"), counter)
    engine = _engine()
    assert isinstance(engine.tracker, DeviceTagIntegrityTracker)
    verified = []
    real_verify = engine.tracker.verify_batch
    engine.tracker.verify_batch = lambda seqs: verified.append(seqs) or real_verify(seqs)
    tokens, errors, reads = _run(engine, counter, fault_at=2)

    err = errors["b"]
    assert isinstance(err, KVIntegrityViolation) and err.reason == "KV_INTEGRITY_VIOLATION"
    assert err.metadata["cause"] == "stale_tag"
    assert tokens["b"] == clean_tokens["b"][:2]  # what b had before the fault, nothing after
    assert INVALID_TOKEN not in tokens["b"]
    assert tokens["a"] == clean_tokens["a"] and tokens["c"] == clean_tokens["c"]
    assert errors["a"] is None and errors["c"] is None
    assert engine.tracker.counters.num_mismatches == 1
    assert verified == [], "every step sampled every sequence: no read-back pass"
    # the tag pass adds no host read to a step, and neither does the abort
    assert clean_tokens == off_tokens
    assert clean_reads == off_reads
    assert reads == clean_reads[: len(reads)]


def test_a_failed_sequence_writes_no_kv_and_the_others_write_theirs():
    slots = torch.tensor([3, 17, 40, 41, 42, 90])
    valid = torch.tensor([1, 0, 1], dtype=torch.int32)
    assert masked_slots(slots[:3], valid, [1, 1, 1]).tolist() == [3, -1, 40]
    assert masked_slots(slots, valid, [1, 4, 1]).tolist() == [3, -1, -1, -1, -1, 90]


def test_the_sampler_gives_a_failed_row_the_sentinel_and_the_others_their_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=2)] * 3
    hist = [([1], [])] * 3
    plain = Sampler()(logits, params, hist, [None] * 3)
    flagged = Sampler()(logits, params, hist, [None] * 3,
                        valid=torch.tensor([1, 0, 1], dtype=torch.int32))
    assert flagged.token_ids == [plain.token_ids[0], INVALID_TOKEN, plain.token_ids[2]]
    assert flagged.logprobs[1] is None and flagged.logprobs[0] == plain.logprobs[0]


def test_the_device_pool_state_follows_the_pool_page_by_page():
    pool = PagePool(4096, 16)
    state = DevicePoolState(pool, torch.device("cpu"))
    refs = [pool.allocate(f"t{i % 2}") for i in range(5)]
    pool.share(refs[1])
    pool.release(refs[2])
    fresh = pool.retag(refs[3])
    pool.tags[refs[4].page_id] += 7  # a direct write, announced as a fault drill does
    pool.touch(refs[4].page_id)
    tags, owners, refcounts = state.flush()
    assert state.pages_sent == 5, "only the pages that changed are sent"
    assert tags.tolist() == list(pool.tags) and owners.tolist() == list(pool.owner_codes)
    assert refcounts.tolist() == list(pool.refcounts)
    assert tags[fresh.page_id] == fresh.tag
    state.flush()
    assert state.pages_sent == 5, "nothing changed: nothing sent"


def test_a_mid_prompt_chunk_is_checked_before_the_step_it_cannot_tell_of():
    # a chunk that samples nothing would never show the sentinel: such a step reads the
    # causes back first and aborts before any KV is read or written, as on CPU
    engine = LLMEngine(tiny_random_checkpoint(), EngineConfig(
        kv_cache_bytes=1 << 20, attention_backend="triton", enable_prefix_caching=False,
        max_num_batched_tokens=16))
    engine.add_request("long", list(range(5, 45)), PARAMS)  # 40 tokens: chunks of 16, 16, 8
    engine.step()
    FaultInjector(engine).bump_tag("long", index=0)
    kv_before = engine.kv_cache.k.clone()
    outs = engine.step()
    assert [o.request_id for o in outs] == ["long"] and outs[0].finished
    assert isinstance(outs[0].error, KVIntegrityViolation)
    assert outs[0].error.metadata["cause"] == "stale_tag"
    assert torch.equal(engine.kv_cache.k, kv_before), "no KV written by the aborted chunk"
    assert not engine.has_unfinished_requests()
