"""Decode steps over static buffers, one set per batch-size bucket, replayed as CUDA graphs.

vLLM's CUDA-graph runner (`vllm/worker/model_runner.py` CUDAGraphRunner, v1's
`gpu_model_runner.capture_model`) and SGLang's `cuda_graph_runner.py`: an all-decode step of n
sequences runs in the smallest bucket >= n; its inputs (token ids, positions, slots, block
table, lengths, the tag pass's valid flags) are copied into that bucket's buffers, and the
attention metadata is built from those buffers alone, so a graph captured over them replays
any later step of the bucket. Padded rows (n..bucket) take token 0 at position 0, slot -1
(they write no page), length 1 and valid 0 (they read no KV either); block-table columns past
the step's widest row are zeroed when a longer step left them behind, so no row reads a stale
page id.

On CUDA every bucket is captured once, after the first request was served eagerly
(`capture`, from the engine's warm-up); on CPU the same buffers run eagerly, so the CPU suite
tests what a replay computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.attention.backend import AttentionBackend, BatchLayout
from runtime.context import ForwardContext, forward_context
from runtime.kv.cache import KVCache
from runtime.platform import platform_for

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# rows of the packed host->device copy: token id, position, slot, length
_IDS, _POS, _SLOT, _LEN = range(4)


def buckets_up_to(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets a decode step of up to `max_num_seqs` sequences may use."""
    last = next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= last)


@dataclass
class DecodeBuffers:
    """One bucket's static inputs on the device (the addresses a captured graph reads)."""

    bucket: int
    packed: torch.Tensor  # [4, bucket] long: token ids, positions, slots, lengths
    block_table: torch.Tensor  # [bucket, max_pages] long
    valid: torch.Tensor  # [bucket] int32
    cu_seqlens_q: torch.Tensor  # [bucket + 1] int32: arange (one query each), never written
    width: int = 0  # block-table columns a step may have left non-zero
    hidden: torch.Tensor | None = None  # [bucket, hidden]: the captured graph's output
    graph: object | None = None  # the captured graph (runtime/platform.py: capture_graph)


class DecodeGraphRunner:
    """All-decode steps of up to `buckets[-1]` sequences on static per-bucket buffers.

    `model`: the decode model; `backend`: one with `static_decode_metadata` (the `triton`
    backend), whose `cuda_graph_safe` this runner sets; `max_pages`: block-table columns (the
    longest sequence's pages). `run(layout, ids, positions)` -> hidden [n, hidden].
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, buckets: tuple[int, ...], max_pages: int) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.device, self.buckets, self.max_pages = device, buckets, max_pages
        self.platform = platform_for(device)
        self._buffers: dict[int, DecodeBuffers] = {}
        self._pool: object | None = None  # the graphs' shared memory pool (CUDA)
        self.replays = 0
        backend.cuda_graph_safe = True  # its metadata now comes from fixed buffers

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n sequences, or None past the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def buffers(self, bucket: int) -> DecodeBuffers:
        buf = self._buffers.get(bucket)
        if buf is None:
            dev = self.device
            packed = torch.zeros(4, bucket, dtype=torch.long, device=dev)
            packed[_SLOT] = -1
            packed[_LEN] = 1
            buf = self._buffers[bucket] = DecodeBuffers(
                bucket, packed, torch.zeros(bucket, self.max_pages, dtype=torch.long, device=dev),
                torch.zeros(bucket, dtype=torch.int32, device=dev),
                torch.arange(bucket + 1, dtype=torch.int32, device=dev))
        return buf

    def fill(self, buf: DecodeBuffers, layout: BatchLayout, input_ids: list[int],
             positions: list[int], slots: list[int]) -> None:
        """Copy one step of n <= bucket decodes into `buf`; rows n.. become padding."""
        n, pad = layout.num_sequences, buf.bucket - layout.num_sequences
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                             slots + [-1] * pad, layout.seq_lens + [1] * pad], dtype=torch.long)
        self.platform.copy_from_host(buf.packed, host)
        width = layout.block_table.shape[1]
        assert width <= self.max_pages, (width, self.max_pages)
        buf.block_table[:n, :width].copy_(layout.block_table)
        buf.block_table[n:, :width].zero_()
        if buf.width > width:  # a longer step's columns: cleared, never read as stale ids
            buf.block_table[:, width:buf.width].zero_()
        buf.width = width
        if layout.seq_valid is None:
            buf.valid[:n].fill_(1)
        else:
            buf.valid[:n].copy_(layout.seq_valid)
        buf.valid[n:].zero_()

    def forward(self, buf: DecodeBuffers) -> torch.Tensor:
        """The model over `buf` ([bucket, hidden]): metadata from the buffers only (what a
        graph captures)."""
        meta = self.backend.static_decode_metadata(  # type: ignore[attr-defined]
            buf.packed[_SLOT], buf.cu_seqlens_q, buf.packed[_LEN], buf.block_table, buf.valid,
            buf.bucket)
        with forward_context(ForwardContext(meta, self.kv_cache, self.backend)):
            return self.model(buf.packed[_IDS], buf.packed[_POS])

    def run(self, layout: BatchLayout, input_ids: list[int], positions: list[int],
            slots: list[int]) -> torch.Tensor:
        """One all-decode step: hidden states [n, hidden] of its n sequences."""
        buf = self.buffers(self.bucket_for(layout.num_sequences) or 0)
        self.fill(buf, layout, input_ids, positions, slots)
        if buf.graph is None:
            hidden = self.forward(buf)
        else:
            buf.graph.replay()  # type: ignore[attr-defined]
            self.replays += 1
            assert buf.hidden is not None
            hidden = buf.hidden
        return hidden[: layout.num_sequences]

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's graph (CUDA only; largest first, sharing one memory pool),
        over padding only: no page is written or read. Returns how many were captured."""
        captured = 0
        for bucket in sorted(self.buckets, reverse=True):
            buf = self.buffers(bucket)
            if buf.graph is not None:
                continue
            buf.packed[_SLOT].fill_(-1)
            buf.valid.zero_()
            done = self.platform.capture_graph(lambda b=buf: self.forward(b), self._pool)
            if done is None:  # a device kind without graphs: the buffers run eagerly
                return 0
            buf.graph, buf.hidden, self._pool = done
            captured += 1
        return captured
