"""Turns a scheduled step into tensors, runs the model over paged KV, returns logits.

Token order in the flat batch: all single-token steps (decodes) first, then each prefill chunk.
When the phases serve different weights, decodes and prefill chunks run as two forwards, each
with its phase's model; both write KV into the one cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.attention import AttentionBackend, BatchLayout
from runtime.context import ForwardContext, forward_context
from runtime.decode_graphs import DecodeGraphRunner
from runtime.kv.cache import KVCache
from runtime.scheduler import ScheduledSequence, SchedulerOutput
from runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, prefill_model: nn.Module, decode_model: nn.Module, kv_cache: KVCache,
                 device: torch.device, backend: AttentionBackend) -> None:
        self.prefill_model = prefill_model
        self.decode_model = decode_model
        self.kv_cache = kv_cache
        self.page_size = kv_cache.spec.page_size
        self.device = device
        self.backend = backend
        # the device tag pass's flags for sequences in a given order (DeviceTagIntegrityTracker
        # .valid_rows), passed to the backend in the layout; None: checked on the host
        self.valid_rows: Callable[[list[Sequence]], torch.Tensor | None] | None = None
        # all-decode steps on static per-bucket buffers (CUDA graphs on CUDA), or None
        self.graphs: DecodeGraphRunner | None = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[list[ScheduledSequence], torch.Tensor]:
        """Run one step. Returns the sequences that sample this step and their logits rows."""
        decodes = sorted((s for s in batch.scheduled if s.num_tokens == 1),
                         key=lambda s: len(s.seq.page_table))
        prefills = [s for s in batch.scheduled if s.num_tokens > 1]
        if not prefills:
            return self._forward(self.decode_model, decodes, [])
        if not decodes or self.decode_model is self.prefill_model:
            return self._forward(self.prefill_model, decodes, prefills)
        dec_samplers, dec_logits = self._forward(self.decode_model, decodes, [])
        pre_samplers, pre_logits = self._forward(self.prefill_model, [], prefills)
        return dec_samplers + pre_samplers, torch.cat([dec_logits, pre_logits])

    def _forward(self, model: nn.Module, decodes: list[ScheduledSequence],
                 prefills: list[ScheduledSequence]
                 ) -> tuple[list[ScheduledSequence], torch.Tensor]:
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        samplers: list[ScheduledSequence] = []
        ps = self.page_size
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.page_table
            slots.extend(table[p // ps].page_id * ps + p % ps for p in range(start, end))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                samplers.append(item)
        layout = self._layout(ordered, len(decodes), slots)
        graphs = self.graphs
        if (not prefills and graphs is not None and model is graphs.model
                and graphs.bucket_for(len(decodes)) is not None):
            hidden = graphs.run(layout, input_ids, positions, slots)
        else:
            meta = self.backend.build_metadata(layout)
            ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
            with forward_context(ForwardContext(meta, self.kv_cache, self.backend)):
                hidden = model(ids_t, pos_t)
        offset = len(decodes)
        for item in prefills:
            sink = None if item.seq.state is None else item.seq.state.prompt_logits
            if sink is not None:  # teacher-forced scoring: every position's next-token logits
                sink.append(model.compute_logits(hidden[offset : offset + item.num_tokens])
                            .float())
            offset += item.num_tokens
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = model.compute_logits(hidden.index_select(0, rows))
        return samplers, logits

    def _layout(self, ordered: list[ScheduledSequence], num_decodes: int,
                slots: list[int]) -> BatchLayout:
        """The batch as every attention backend receives it: varlen offsets, one block table."""
        query_lens = [item.num_tokens for item in ordered]
        seq_lens = [item.seq.num_computed_tokens + item.num_tokens for item in ordered]
        num_pages = [len(item.seq.page_table) for item in ordered]
        # One tensor built from one flat list (not one small tensor per sequence).
        max_pages = max(num_pages, default=0)
        flat: list[int] = []
        for item in ordered:
            table = item.seq.page_table
            flat.extend(ref.page_id for ref in table)
            flat.extend([0] * (max_pages - len(table)))
        cu_q, cu_k = [0], [0]
        for q, k in zip(query_lens, seq_lens, strict=True):
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + k)
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        valid = None if self.valid_rows is None else self.valid_rows([i.seq for i in ordered])
        return BatchLayout(num_decodes, self.page_size, query_lens, seq_lens, num_pages,
                           tensor(cu_q), tensor(cu_k), tensor(flat).view(len(ordered), max_pages),
                           tensor(slots), valid)
