"""The `triton` attention backend (runtime/attention/triton.py) without the model: how it is
chosen and refused, and its tag check (one batched `verify_pages` launch, in Triton's
interpreter) deciding every sequence as the host tracker does. The engine end to end on it:
tests/runtime/test_triton_engine.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.triton_pools import DEVICE  # sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from runtime.attention import BACKENDS, make_backend, resolve_backend_name
from runtime.attention.triton import TritonAttentionBackend
from runtime.attention.triton_tags import DeviceTagIntegrityTracker
from runtime.config import EngineConfig
from runtime.engine_flags import FLAGS
from runtime.errors import InvalidArgument
from runtime.extras import MissingExtra
from runtime.integrity import TagIntegrityTracker
from runtime.kv.pages import PagePool, PageRef
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence

CPU = torch.device("cpu")


def test_triton_is_a_registered_choice_and_auto_stays_cpu_on_cpu():
    assert "triton" in BACKENDS
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"
    flag = next(f for f in FLAGS if f.name == "attention-backend")
    assert "triton" in flag.choices
    assert resolve_backend_name("auto", CPU) == "cpu"
    backend = make_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    assert not backend.runs_fused_decode


def test_without_triton_the_backend_names_the_cuda_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(MissingExtra, match=r"'cuda' extra \(triton is not installed\)") as e:
        make_backend("triton", DEVICE)
    assert e.value.extra == "cuda"


def test_on_cpu_outside_the_interpreter_it_is_a_typed_error(monkeypatch):
    if DEVICE.type != "cpu":
        pytest.skip("the interpreter rule is for CPU tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidArgument, match="TRITON_INTERPRET=1") as e:
        make_backend("triton", CPU)
    assert e.value.metadata["field"] == "attention_backend"


def _sequences(pool: PagePool, pages: list[int]) -> list[Sequence]:
    params = SamplingParams(max_tokens=1)
    seqs = []
    for i, n in enumerate(pages):
        seq = Sequence(f"r{i}", [1, 2, 3], params, tenant=f"t{i % 2}")
        for _ in range(n):
            ref = pool.allocate(seq.tenant)
            seq.page_table.append(ref)
            seq.recorded_pages.append(ref)
        seqs.append(seq)
    return seqs


def test_the_device_tag_pass_fails_exactly_the_sequences_the_host_check_fails():
    pool = PagePool(4096, 16)
    seqs = _sequences(pool, [3, 40, 1, 7, 0, 600, 5])  # 600 pages: several BLOCK chunks
    stale = seqs[1].recorded_pages[17]
    pool.release(stale)
    pool.allocate("t0")  # page reused by another hold: stale tag (and live)
    seqs[3].page_table[2] = seqs[0].page_table[0]  # remapped
    seqs[5].page_table.append(PageRef(9, 0, 0))  # an entry never recorded
    pool.release(seqs[6].recorded_pages[4])  # freed while still in the table
    host = TagIntegrityTracker(pool).verify_batch(seqs)
    device = DeviceTagIntegrityTracker(pool, DEVICE)
    found = device.verify_batch(seqs)
    assert [(v.seq.request_id, v.page_id, v.expected_tag, v.found_tag, v.cause) for v in found] \
        == [(v.seq.request_id, v.page_id, v.expected_tag, v.found_tag, v.cause) for v in host]
    assert {v.seq.request_id for v in found} == {"r1", "r3", "r5", "r6"}
    assert device.last_valid.tolist() == [1, 0, 1, 0, 1, 0, 0]
    assert device.counters.checks_run == 1
    assert device.counters.pages_checked == sum(len(s.page_table) for s in seqs)
    assert device.counters.num_mismatches == 4


def test_the_device_tag_pass_reuses_rows_only_while_nothing_they_came_from_changed():
    pool = PagePool(4096, 16)
    seqs = _sequences(pool, [3, 40, 1, 7, 0, 600, 5])
    device = DeviceTagIntegrityTracker(pool, DEVICE)
    total = sum(len(s.page_table) for s in seqs)
    assert device.verify_batch(seqs) == [] and device.tables.entries_built == total
    assert device.verify_batch(seqs) == [] and device.tables.entries_built == total  # reused
    ref = pool.allocate(seqs[5].tenant)  # a decode step's new page: only it is built
    seqs[5].page_table.append(ref)
    seqs[5].recorded_pages.append(ref)
    assert device.verify_batch(seqs) == [] and device.tables.entries_built == total + 1
    # the previous test's corruptions, each made in place after its rows were kept
    stale = seqs[1].recorded_pages[17]
    pool.release(stale)
    pool.allocate("t0")
    seqs[3].page_table[2] = seqs[0].page_table[0]
    seqs[5].page_table.append(PageRef(9, 0, 0))
    pool.release(seqs[6].recorded_pages[4])
    seqs[2].page_table[0], seqs[0].page_table[1] = seqs[0].page_table[1], seqs[2].page_table[0]
    host = TagIntegrityTracker(pool).verify_batch(seqs)
    found = device.verify_batch(seqs)
    assert [(v.seq.request_id, v.page_id, v.expected_tag, v.found_tag, v.cause) for v in found] \
        == [(v.seq.request_id, v.page_id, v.expected_tag, v.found_tag, v.cause) for v in host]
    assert {v.seq.request_id for v in found} == {"r0", "r1", "r2", "r3", "r5", "r6"}
    assert device.verify_batch(seqs[:2]) != [] and len(device.tables._rows) == 2  # dropped


def test_the_device_tag_pass_is_the_triton_backends_tracker():
    pool = PagePool(8, 16)
    backend = make_backend("triton", DEVICE)
    assert isinstance(backend.integrity_tracker("tags", pool), DeviceTagIntegrityTracker)
    assert backend.integrity_tracker("off", pool).verify_batch(_sequences(pool, [1])) == []
    assert type(make_backend("torch", None).integrity_tracker("tags", pool)) \
        is TagIntegrityTracker
