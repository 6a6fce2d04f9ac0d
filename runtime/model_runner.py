"""Turns a scheduled step into tensors, runs the model over paged KV, returns logits.

Token order in the flat batch: all single-token steps (decodes) first, then each prefill chunk.
When the phases serve different weights, decodes and prefill chunks run as two forwards, each
with its phase's model; both write KV into the one cache.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import decode_pads_to_longest
from kernels.cpu_ops import build_pending, native
from runtime.context import (
    AttentionMetadata,
    DecodeGroup,
    ForwardContext,
    PrefillSlice,
    forward_context,
)
from runtime.kv.cache import KVCache
from runtime.progress import waiting
from runtime.scheduler import ScheduledSequence, SchedulerOutput


class ModelRunner:
    def __init__(self, prefill_model: nn.Module, decode_model: nn.Module, kv_cache: KVCache,
                 device: torch.device) -> None:
        self.prefill_model = prefill_model
        self.decode_model = decode_model
        self.kv_cache = kv_cache
        self.page_size = kv_cache.spec.page_size
        self.device = device
        if device.type == "cpu" and build_pending():  # else loaded (or skipped) on first use
            with waiting("build C++ CPU ops"):
                native()

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
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decodes=self._decode_groups(decodes),
            prefills=[],
        )
        offset = len(decodes)
        for item in prefills:
            meta.prefills.append(self._prefill_slice(item, offset))
            offset += item.num_tokens
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(meta, self.kv_cache)):
            hidden = model(ids_t, pos_t)
        for item, piece in zip(prefills, meta.prefills, strict=True):
            sink = None if item.seq.state is None else item.seq.state.prompt_logits
            if sink is not None:  # teacher-forced scoring: every position's next-token logits
                sink.append(model.compute_logits(hidden[piece.start : piece.end]).float())
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = model.compute_logits(hidden.index_select(0, rows))
        return samplers, logits

    def _decode_groups(self, decodes: list[ScheduledSequence]) -> list[DecodeGroup]:
        """Where decode attention pads to the longest context, split decodes (sorted by page
        count) where the longest would more than double the group's padding: a short sequence
        never pays for a long one's whole context. Otherwise one group, one call per layer."""
        groups: list[DecodeGroup] = []
        start = 0
        split = decode_pads_to_longest(self.device)
        for i in range(1, len(decodes) + 1):
            if i == len(decodes) or (split and len(decodes[i].seq.page_table)
                                     > 2 * len(decodes[start].seq.page_table)):
                table, lens = self._decode_tables(decodes[start:i])
                groups.append(DecodeGroup(start, i, table, lens))
                start = i
        return groups

    def _decode_tables(self, decodes: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        # One tensor built from one flat list each (not one small tensor per sequence).
        max_pages = max(len(s.seq.page_table) for s in decodes)
        flat: list[int] = []
        for item in decodes:
            table = item.seq.page_table
            flat.extend(ref.page_id for ref in table)
            flat.extend([0] * (max_pages - len(table)))
        lens = [item.seq.num_computed_tokens + 1 for item in decodes]
        return (torch.tensor(flat, dtype=torch.long, device=self.device).view(-1, max_pages),
                torch.tensor(lens, dtype=torch.long, device=self.device))

    def _prefill_slice(self, item: ScheduledSequence, offset: int) -> PrefillSlice:
        seq = item.seq
        start = seq.num_computed_tokens
        context_len = start + item.num_tokens
        num_pages = -(-context_len // self.page_size)
        page_ids = torch.tensor([r.page_id for r in seq.page_table[:num_pages]], dtype=torch.long)
        mask = None
        if start > 0:  # attends to earlier chunks: causal with an offset
            q_pos = torch.arange(start, context_len).unsqueeze(1)
            mask = torch.arange(context_len).unsqueeze(0) <= q_pos
            mask = mask.to(self.device)
        return PrefillSlice(offset, offset + item.num_tokens, page_ids.to(self.device),
                            context_len, mask)
