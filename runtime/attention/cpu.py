"""The `cpu` attention backend: the C++ CPU kernels through the `tessera` ops, and the fused
step (`kernels.decode_llama`) for every step of Llama-family block-weight models, prefill
chunks included (each chunk token one row of its decode kernel, as prefill attention is here).

Decode groups: where decode attention pads every sequence to its group's longest context
(the torch twin does; the C++ op reads each sequence's own pages), decodes (sorted by page
count) are split where the longest would more than double the group's padding; otherwise one
group, one call per layer. Prefill chunks attend one sequence at a time, with a causal mask
offset by the tokens already cached.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import decode_pads_to_longest, paged_decode_attention, paged_prefill_attention
from kernels import store_kv as store_kv_op
from kernels.cpu_ops import build_pending, native
from runtime.attention.backend import AttentionBackend, BatchLayout
from runtime.attention.fused_decode import FusedSteps, fused_rows
from runtime.context import AttentionMetadata, DecodeGroup
from runtime.kv.cache import LayerKV
from runtime.progress import waiting


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"
    runs_fused_decode = True
    cuda_graph_safe = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.split_decodes = decode_pads_to_longest(device)
        self.fused = FusedSteps()
        if build_pending():  # else loaded (or skipped) on first use
            with waiting("build C++ CPU ops"):
                native()

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        return AttentionMetadata(layout.slot_mapping, self._decode_groups(layout),
                                 layout.prefill_slices())

    def _decode_groups(self, layout: BatchLayout) -> list[DecodeGroup]:
        groups: list[DecodeGroup] = []
        n, pages = layout.num_decodes, layout.num_pages
        start = 0
        for i in range(1, n + 1):
            if i == n or (self.split_decodes and pages[i] > 2 * pages[start]):
                groups.append(layout.decode_group(start, i))
                start = i
        return groups

    def store_kv(self, meta: AttentionMetadata, kv: LayerKV, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        # Smoothed 1-byte pages (runtime/kv/smoothing.py): keys stored as (k - shift) / scale
        # and read by q * scale, values stored as v / v_scale and the output times v_scale.
        store_kv_op(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale, kv.hadamard,
                    kv.k_shift, kv.k_channel_scale, kv.v_channel_scale)

    def attend(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
               scale: float) -> torch.Tensor:
        parts = []
        for g in meta.decodes:
            parts.append(paged_decode_attention(q[g.start : g.end], kv.k, kv.v, g.page_table,
                                                g.context_lens, scale, kv.k_scale, kv.v_scale,
                                                kv.hadamard, kv.k_channel_scale,
                                                kv.v_channel_scale))
        for p in meta.prefills:
            parts.append(paged_prefill_attention(q[p.start : p.end], kv.k, kv.v, p.page_ids,
                                                 p.context_len, p.mask, scale,
                                                 kv.k_scale, kv.v_scale, kv.hadamard,
                                                 kv.k_channel_scale, kv.v_channel_scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def run_fused_decode(self, model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, kv_cache: object) -> torch.Tensor | None:
        if x.device.type != "cpu":
            return None
        step = self.fused.step_for(model, x, kv_cache)
        if step is None:
            return None
        table, lens = fused_rows(meta)
        cos, sin = model.rotary.cos_sin(positions, x.dtype)  # type: ignore[operator]
        return step(x, cos, sin, meta.slot_mapping, table, lens)
