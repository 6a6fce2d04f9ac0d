"""The graph-ready decode runner (runtime/decode_graphs.py) on the `triton` backend, in Triton's
interpreter on CPU, where it runs eagerly over the static buffers a CUDA graph would replay:
it computes what the plain eager step computes for ragged batches that change bucket, its
padded rows write no page, a longer step's block-table columns are cleared for a shorter one,
and only with it is the backend `cuda_graph_safe`. The capture itself needs CUDA
(ops/bench/gpu_check_engine.py)."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.triton_pools  # noqa: F401  sets TRITON_INTERPRET=1 (before triton) on CPU

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from runtime.attention.backend import BatchLayout
from runtime.config import EngineConfig
from runtime.decode_graphs import DecodeGraphRunner, buckets_up_to
from runtime.engine import LLMEngine
from runtime.errors import InvalidArgument
from runtime.sampling_params import SamplingParams
from tests.helpers import capture_logits, tiny_random_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _engine(decode_graphs: str) -> LLMEngine:
    return LLMEngine(tiny_random_checkpoint(), EngineConfig(
        kv_cache_bytes=1 << 20, attention_backend="triton", decode_graphs=decode_graphs,
        dtype="float32", enable_prefix_caching=False, max_num_seqs=8))


def _ragged_run(engine: LLMEngine, monkeypatch) -> tuple[dict, list[int]]:
    """Requests arrive over the steps, so all-decode steps of 1, 5, 4 and 2 sequences (buckets
    1, 8, 4, 2) follow each other; returns every sampled logits row and each step's size."""
    logits = capture_logits(engine, monkeypatch)
    arrivals = {0: 1, 2: 2, 3: 2}
    sizes, step, made = [], 0, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for _ in range(arrivals.get(step, 0)):
            engine.add_request(f"r{made}", list(range(3 + 7 * made, 12 + 9 * made)), PARAMS)
            made += 1
        sizes.append(len(engine.step()))
        step += 1
    return logits, sizes


def test_the_runner_computes_what_the_eager_step_computes_across_buckets(monkeypatch):
    eager, eager_sizes = _ragged_run(_engine("off"), monkeypatch)
    runner_engine = _engine("eager")
    used = []
    real_run = DecodeGraphRunner.run
    monkeypatch.setattr(DecodeGraphRunner, "run",
                        lambda self, layout, *a: used.append(layout.num_sequences)
                        or real_run(self, layout, *a))
    static, sizes = _ragged_run(runner_engine, monkeypatch)
    assert sizes == eager_sizes
    assert {runner_engine.runner.graphs.bucket_for(n) for n in used} >= {1, 4, 8, 2}, used
    assert static.keys() == eager.keys()
    for rid in eager:
        for got, want in zip(static[rid], eager[rid], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padded_rows_write_no_page(monkeypatch):
    engine = _engine("eager")
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5, 9 + i)), PARAMS)
    engine.step()  # prefill
    written = []
    graphs = engine.runner.graphs
    real_fill = graphs.fill
    monkeypatch.setattr(graphs, "fill", lambda buf, layout, ids, pos, slots:
                        written.extend(slots) or real_fill(buf, layout, ids, pos, slots))
    kv = engine.kv_cache
    before_k, before_v = kv.k.clone(), kv.v.clone()
    engine.step()  # three decodes in bucket 4: one padded row
    assert len(written) == 3 and graphs.bucket_for(3) == 4
    ps = engine.pool.page_size
    changed_k = (kv.k != before_k).any(-1).any(0).any(0)  # [pages, page_size]
    changed_v = (kv.v != before_v).any(-1).any(0).any(0)
    allowed = torch.zeros_like(changed_k)
    for s in written:
        allowed[s // ps, s % ps] = True
    assert engine.pool.refcounts[0] > 0, "page 0, where padded rows' tables point, is live"
    assert not (changed_k & ~allowed).any() and not (changed_v & ~allowed).any()
    assert changed_k[allowed].all()


def _layout(tables: list[list[int]], valid: list[int] | None = None) -> BatchLayout:
    n, width = len(tables), max(len(t) for t in tables)
    flat = [p for t in tables for p in t + [0] * (width - len(t))]
    return BatchLayout(n, 16, [1] * n, [16 * len(t) for t in tables], [len(t) for t in tables],
                       torch.arange(n + 1), torch.arange(n + 1),
                       torch.tensor(flat).view(n, width), torch.arange(n),
                       None if valid is None else torch.tensor(valid, dtype=torch.int32))


def test_a_longer_steps_block_table_columns_are_cleared_for_a_shorter_one():
    engine = _engine("eager")
    graphs = engine.runner.graphs
    buf = graphs.buffers(4)
    graphs.fill(buf, _layout([[7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]), [1, 2, 3],
                [0, 0, 0], [112, 192, 208])
    assert buf.block_table[:3, :5].tolist() == [[7, 8, 9, 10, 11], [12, 0, 0, 0, 0],
                                                [13, 14, 15, 16, 0]]
    graphs.fill(buf, _layout([[3, 4], [5]], valid=[1, 0]), [1, 2], [0, 0], [48, 80])
    assert buf.block_table[:, :6].tolist() == [[3, 4, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0],
                                               [0] * 6, [0] * 6]
    assert not buf.block_table.any(1)[2:].any(), "no padded row names a page"
    assert buf.packed.tolist() == [[1, 2, 0, 0], [0, 0, 0, 0], [48, 80, -1, -1],
                                   [32, 16, 1, 1]]
    assert buf.valid.tolist() == [1, 0, 0, 0]
    meta = engine.attention.static_decode_metadata(
        buf.packed[2], buf.cu_seqlens_q, buf.packed[3], buf.block_table, buf.valid, 4)
    assert meta.slot_mapping.tolist() == [48, -1, -1, -1], "an invalid row writes no slot"


def test_only_the_runner_makes_the_backend_graph_safe():
    assert not _engine("off").attention.cuda_graph_safe
    on = _engine("auto")
    assert on.attention.cuda_graph_safe and on.runner.graphs is not None
    assert on.runner.graphs.buckets == buckets_up_to(8) == (1, 2, 4, 8)
    assert on.runner.graphs.capture() == 0, "no capture without CUDA"
    with pytest.raises(InvalidArgument, match="decode_graphs"):
        EngineConfig(decode_graphs="always")
