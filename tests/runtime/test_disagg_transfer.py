"""KV transfer between two real engines in one process (the default model): greedy parity with
colocated serving, the format change at import, and every failure leaving pages idle."""

from __future__ import annotations

import pytest

from runtime import LLM
from runtime.disagg.export import KVExport
from runtime.disagg.importer import KVImport
from runtime.disagg.local import LocalTransfer
from runtime.errors import (
    InvalidArgument,
    KVIntegrityViolation,
    KVPoolExhausted,
    TransferDeadlineExceeded,
)
from runtime.faults import FaultInjector
from runtime.sampling_params import SamplingParams
from tests.helpers import capture_logits

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The three primary colors are",
    "Write a haiku about the sea. The waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans to walk on the Moon were",
    "A list of fruits: apple, banana, cherry,",
    "Translate to French: good morning, my friend. Answer:",
    "The quick brown fox jumps over the lazy dog because the dog was",
    "Q: What is 12 times 12?\nA:",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of the module on one torch thread (see `one_torch_thread`)."""


@pytest.fixture(scope="module")
def fp8_llm(one_torch_thread):
    """A decode-side engine with FP8 KV (a small pool: 400 pages)."""
    return LLM(kv_cache_bytes=26 << 20, max_num_seqs=16, kv_cache_dtype="fp8")


@pytest.fixture
def fp8_engine(fp8_llm):
    yield fp8_llm.engine
    for rid in list(fp8_llm.engine.requests):
        fp8_llm.engine.abort_request(rid)
    fp8_llm.engine.check_quiescent()


def _ids(engine, tag: str) -> dict[str, list[int]]:
    return {f"{tag}-{i}": engine.tokenizer.encode(f"[{tag}] {p}") for i, p in enumerate(PROMPTS)}


def _colocated(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request("colo-" + rid, ids, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id.removeprefix("colo-")] = o.outputs[0].token_ids
    return out


def _flip_payload_byte(seq: int):
    def fault(frame_seq: int, data: bytes) -> bytes:
        if frame_seq != seq:
            return data
        bad = bytearray(data)
        bad[-7] ^= 0x10  # inside the payload (msgpack puts it last)
        return bytes(bad)
    return fault


def test_same_format_transfer_is_token_identical_to_colocated(engine):
    prompts = dict(list(_ids(engine, "same").items())[:3])
    local = LocalTransfer(engine, engine)
    got = local.generate(prompts, GREEDY)
    want = _colocated(engine, prompts)
    assert {rid: r.token_ids for rid, r in got.items()} == want
    assert all(r.error is None and r.finish_reason == "length" for r in got.values())
    assert local.imported.transfers == 3 and local.imported.failures == {}
    assert local.imported.bytes == local.exported.bytes > 0


def test_imported_pages_are_the_only_kv_decode_reads(engine):
    """Poison the reservation: only a complete import makes the output right."""
    ids = engine.tokenizer.encode("[poison] " + PROMPTS[0])
    imp = KVImport.reserve(engine, "p", ids, GREEDY)
    pages = [r.page_id for r in imp.reserved]
    engine.kv_cache.k[:, :, pages] = float("nan")
    engine.kv_cache.v[:, :, pages] = float("nan")
    exp = KVExport.start(engine, "p", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    assert {r.page_id for r in exp.seq.recorded_pages}.isdisjoint(pages)
    for data in exp.frames(imp.first_page):
        imp.accept(data)
    exp.release()
    seq = imp.commit()
    assert [r.tag for r in seq.recorded_pages] == [engine.pool.tags[p] for p in pages]
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.error is None
    assert out.outputs[0].token_ids == _colocated(engine, {"p": ids})["p"]


def test_fp8_decode_side_matches_colocated_fp8(engine, fp8_engine, monkeypatch):
    """Prefill over fp32 KV, decode over FP8 KV converted at import, vs colocated FP8 (whose
    prefill already attends over FP8 KV). Where the tokens part, the colocated run's logits
    show a near-tie: the divergence is rounding, not a wrong page."""
    prompts = _ids(engine, "fp8")
    local = LocalTransfer(engine, fp8_engine)
    got = local.generate(prompts, GREEDY)
    logits = capture_logits(fp8_engine, monkeypatch)
    want = _colocated(fp8_engine, prompts)
    assert all(r.error is None for r in got.values())
    report = {}
    for rid in prompts:
        a, b = got[rid].token_ids, want[rid]
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is None:
            continue
        row = logits["colo-" + rid][i]
        gap = float(row[b[i]] - row[a[i]])
        report[rid] = (i, round(gap, 3))
        assert 0 <= gap < 1.0, (rid, i, gap)  # the disaggregated pick was a close second
    print(f"\nfp32 -> fp8 import vs colocated fp8: {len(prompts) - len(report)}/{len(prompts)} "
          f"identical over {GREEDY.max_tokens} tokens; (first divergence, logit gap): {report}")
    assert len(report) <= len(prompts) // 2


@pytest.fixture(scope="module")
def bf16_llm(one_torch_thread):
    """A prefill-side engine with BF16 KV, as a disaggregated prefill pool runs."""
    return LLM(kv_cache_bytes=26 << 20, max_num_seqs=16, kv_cache_dtype="bf16")


@pytest.fixture(scope="module")
def int8_llm(one_torch_thread):
    """A decode-side engine with INT8 KV (rotated and smoothed as FP8; the same 400 pages)."""
    return LLM(kv_cache_bytes=26 << 20, max_num_seqs=16, kv_cache_dtype="int8")


def test_int8_decode_side_matches_colocated_int8(bf16_llm, int8_llm, monkeypatch):
    """Prefill over BF16 KV, decode over INT8 KV quantized and rotated at import (the bytes a
    decode engine writes itself from those values: test_disagg_frames.py), vs colocated INT8.
    Where the tokens part, the colocated run's logits show a near tie."""
    prefill, decode = bf16_llm.engine, int8_llm.engine
    assert decode.kv_cache.spec.hadamard and decode.kv_cache.key_smoothing is not None
    prompts = _ids(prefill, "int8")
    local = LocalTransfer(prefill, decode)
    got = local.generate(prompts, GREEDY)
    logits = capture_logits(decode, monkeypatch)
    want = _colocated(decode, prompts)
    assert all(r.error is None for r in got.values())
    assert local.imported.transfers == len(prompts) and local.imported.failures == {}
    report = {}
    for rid in prompts:
        a, b = got[rid].token_ids, want[rid]
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is None:
            continue
        row = logits["colo-" + rid][i]
        gap = float(row[b[i]] - row[a[i]])
        report[rid] = (i, round(gap, 3))
        assert 0 <= gap < 1.0, (rid, i, gap)  # the disaggregated pick was a close second
    print(f"\nbf16 -> int8 import vs colocated int8: {len(prompts) - len(report)}/{len(prompts)} "
          f"identical over {GREEDY.max_tokens} tokens; (first divergence, logit gap): {report}")
    assert len(report) <= len(prompts) // 4
    for engine in (prefill, decode):
        engine.check_quiescent()


def test_int8_to_int8_transfer_copies_bytes_and_scales(int8_llm):
    """INT8 frames carry the codes and scales: an int8 -> int8 transfer is token-identical to
    colocated INT8 (the same pages, byte for byte)."""
    engine = int8_llm.engine
    prompts = dict(list(_ids(engine, "i8i8").items())[:3])
    local = LocalTransfer(engine, engine)
    got = local.generate(prompts, GREEDY)
    want = _colocated(engine, prompts)
    assert {rid: r.token_ids for rid, r in got.items()} == want
    assert local.imported.bytes == local.exported.bytes > 0
    engine.check_quiescent()


def test_corrupted_frame_aborts_that_request_only(engine, fp8_engine):
    prompts = dict(list(_ids(engine, "corrupt").items())[:3])
    victim = list(prompts)[1]
    local = LocalTransfer(engine, fp8_engine)
    got = local.generate(prompts, GREEDY, faults={victim: _flip_payload_byte(1)})
    err = got[victim].error
    assert isinstance(err, KVIntegrityViolation)
    assert err.metadata["cause"] == "transfer" and err.metadata["detail"] == "checksum"
    assert len(got[victim].token_ids) == 1  # only the first token, streamed by the prefill side
    del prompts[victim]
    clean = LocalTransfer(engine, fp8_engine).generate(prompts, GREEDY)
    assert all(got[r].error is None and got[r].token_ids == clean[r].token_ids for r in prompts)
    assert local.imported.failures == {"checksum": 1}


@pytest.mark.parametrize("fault", ["drop", "duplicate", "reorder", "truncate_end"])
def test_sequence_faults_abort_fail_closed(engine, fp8_engine, fault):
    ids = engine.tokenizer.encode("[seq] " + PROMPTS[2] * 3)
    imp = KVImport.reserve(fp8_engine, "s", ids, GREEDY)
    exp = KVExport.start(engine, "s", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    frames = list(exp.frames(imp.first_page, max_frame_bytes=64 << 10))
    exp.release()
    assert len(frames) > 4
    if fault == "drop":
        frames.pop(2)
    elif fault == "duplicate":
        frames.insert(2, frames[2])
    elif fault == "reorder":
        frames[2], frames[3] = frames[3], frames[2]
    else:
        frames.pop()
    with pytest.raises(KVIntegrityViolation) as info:
        for data in frames:
            imp.accept(data)
        imp.commit()
    assert info.value.metadata["cause"] == "transfer"
    assert imp.state == "failed" and "s" not in fp8_engine.requests


def test_cancel_mid_transfer_and_stall_free_both_sides(engine, fp8_engine):
    ids = engine.tokenizer.encode("[cancel] " + PROMPTS[4] * 4)
    imp = KVImport.reserve(fp8_engine, "c", ids, GREEDY)
    held = fp8_engine.pool.num_used_pages
    assert held >= imp.num_pages
    exp = KVExport.start(engine, "c", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    stream = exp.frames(imp.first_page, max_frame_bytes=64 << 10)
    imp.accept(next(stream))
    imp.accept(next(stream))
    later = next(stream)
    imp.abort()  # the client left mid-transfer
    exp.release()
    with pytest.raises(InvalidArgument, match="failed"):
        imp.accept(later)
    with pytest.raises(InvalidArgument, match="released"):
        next(stream)
    # A stalled transfer: its deadline passes before the next frame.
    stalled = KVImport.reserve(fp8_engine, "d", ids, GREEDY, deadline_s=0.0)
    with pytest.raises(TransferDeadlineExceeded):
        stalled.accept(b"")
    assert imp.counters.failures["cancelled"] == 1 and stalled.counters.failures["deadline"] == 1


def test_full_decode_pool_refuses_before_any_byte_moves(engine, fp8_engine):
    pool = fp8_engine.pool
    fp8_engine.prefix_cache.clear()  # evictable pages would make room
    hog = [pool.allocate("hog") for _ in range(pool.num_free_pages - 1)]
    try:
        with pytest.raises(KVPoolExhausted):
            KVImport.reserve(fp8_engine, "full", engine.tokenizer.encode(PROMPTS[3] * 4), GREEDY)
        assert pool.num_free_pages == 1
    finally:
        for ref in hog:
            pool.release(ref)


def test_decode_side_holding_the_prefix_imports_only_what_it_lacks(engine, fp8_engine):
    first = engine.tokenizer.encode("[turn] " + PROMPTS[6] * 3)
    local = LocalTransfer(engine, fp8_engine)
    local.generate({"t1": first}, GREEDY)
    pages_first = local.imported.pages
    second = first + engine.tokenizer.encode(" And then the fox said")
    got = local.generate({"t2": second}, GREEDY)
    assert got["t2"].error is None
    held = len(first) // engine.pool.page_size
    assert local.imported.pages - pages_first == engine.pool.pages_for_tokens(len(second)) - held
    assert got["t2"].num_cached_tokens >= held * engine.pool.page_size
    fp8_engine.prefix_cache.clear()  # the same turn again, every page imported
    again = local.generate({"t3": second}, GREEDY)
    assert got["t2"].token_ids == again["t3"].token_ids


def test_prefill_pages_that_change_during_export_stop_it(engine, fp8_engine):
    ids = engine.tokenizer.encode("[stale] " + PROMPTS[5] * 3)
    imp = KVImport.reserve(fp8_engine, "x", ids, GREEDY)
    exp = KVExport.start(engine, "x", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    stream = exp.frames(imp.first_page, max_frame_bytes=64 << 10)
    imp.accept(next(stream))
    imp.accept(next(stream))
    bumped = exp.seq.recorded_pages[0].page_id
    engine.pool.tags[bumped] += 1  # reused under the export
    with pytest.raises(KVIntegrityViolation):
        next(stream)
    assert exp.counters.failures == {"stale_tag": 1} and not exp.seq.recorded_pages
    imp.abort("sender")
    assert imp.state == "failed" and "x" not in fp8_engine.requests
    # The bumped page is lost to bookkeeping, as after any use-after-free: give it back.
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    FaultInjector(engine)._force_free(bumped)


def test_a_reserved_page_taken_mid_transfer_is_never_written(engine, fp8_engine):
    """A use-after-free on the decode side hands a reserved page to another holder mid-transfer:
    the next frame for it fails closed (`stale`) and the new holder's bytes stay as they were."""
    ids = engine.tokenizer.encode("[taken] " + PROMPTS[2] * 3)
    imp = KVImport.reserve(fp8_engine, "t", ids, GREEDY)
    exp = KVExport.start(engine, "t", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    frames = list(exp.frames(imp.first_page, max_frame_bytes=64 << 10))
    exp.release()
    imp.accept(frames[0])
    imp.accept(frames[1])  # pages 0-1 of the first layers: the last page is still to come
    taken = imp.reserved[-1]
    FaultInjector(fp8_engine)._force_free(taken.page_id)
    thief = fp8_engine.pool.allocate("thief")
    assert thief.page_id == taken.page_id and thief.tag != taken.tag
    kv = fp8_engine.kv_cache
    before = kv.k[:, :, thief.page_id].clone(), kv.v[:, :, thief.page_id].clone()
    with pytest.raises(KVIntegrityViolation) as info:
        for data in frames[2:]:
            imp.accept(data)
    assert info.value.metadata["detail"] == "stale" and imp.state == "failed"
    assert kv.k[:, :, thief.page_id].equal(before[0])
    assert kv.v[:, :, thief.page_id].equal(before[1])
    assert "t" not in fp8_engine.requests and not imp.reserved
    fp8_engine.pool.release(thief)


def test_a_failed_transfer_publishes_nothing_and_its_retry_starts_fresh(engine, fp8_engine):
    """A transfer that fails verification leaves no readable page: no sequence, no prefix-cache
    entry. Its retry (same request id) reserves anew, receives every page again under fresh
    tags (no (page, tag) of the failed attempt can match), and decodes as a clean run does."""
    ids = engine.tokenizer.encode("[retry] " + PROMPTS[6] * 3)
    failed = KVImport.reserve(fp8_engine, "r", ids, GREEDY)
    old_refs = list(failed.reserved)
    exp = KVExport.start(engine, "r", ids, GREEDY)
    while not exp.prefilled:
        engine.step()
    with pytest.raises(KVIntegrityViolation):
        for data in exp.frames(failed.first_page, 64 << 10, _flip_payload_byte(3)):
            failed.accept(data)
    exp.release()
    assert "r" not in fp8_engine.requests and not failed.reserved
    local = LocalTransfer(engine, fp8_engine)
    retry = KVImport.reserve(fp8_engine, "r", ids, GREEDY, counters=local.imported)
    assert retry.first_page == 0  # nothing of the failed attempt was published
    assert set(old_refs).isdisjoint(retry.reserved)
    retry.abort()
    got = local.generate({"r": ids}, GREEDY)["r"]
    assert got.error is None and local.imported.pages == fp8_engine.pool.pages_for_tokens(len(ids))
    fp8_engine.prefix_cache.clear()
    clean = LocalTransfer(engine, fp8_engine).generate({"clean": ids}, GREEDY)["clean"]
    assert got.token_ids == clean.token_ids
