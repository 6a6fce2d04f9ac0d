"""The `torch` attention backend: the kernels' torch twins called directly, no native code, on
any device. The readable reference every other backend is tested against (and how the engine
runs where no device kernel exists yet). Decodes attend in one call padded to the longest
context; each prefill chunk attends with its causal mask.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import ref_paged_decode_attention, ref_paged_prefill_attention
from kernels.store_kv import ref_store_kv
from runtime.attention.backend import AttentionBackend, BatchLayout
from runtime.context import AttentionMetadata
from runtime.kv.cache import LayerKV


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    runs_fused_decode = False
    cuda_graph_safe = False  # prefill masks and per-sequence slices are built every step

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        n = layout.num_decodes
        decodes = [layout.decode_group(0, n)] if n else []
        return AttentionMetadata(layout.slot_mapping, decodes, layout.prefill_slices())

    def store_kv(self, meta: AttentionMetadata, kv: LayerKV, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        assert kv.v is not None, "K/V pages (MLA latent pages have their own layer)"
        ref_store_kv(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale, kv.hadamard,
                     kv.k_shift, kv.k_channel_scale, kv.v_channel_scale)

    def attend(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
               scale: float) -> torch.Tensor:
        assert kv.v is not None
        parts = [ref_paged_decode_attention(q[g.start : g.end], kv.k, kv.v, g.page_table,
                                            g.context_lens, scale, kv.k_scale, kv.v_scale,
                                            kv.hadamard, kv.k_channel_scale, kv.v_channel_scale)
                 for g in meta.decodes]
        parts += [ref_paged_prefill_attention(q[p.start : p.end], kv.k, kv.v, p.page_ids,
                                              p.context_len, p.mask, scale, kv.k_scale,
                                              kv.v_scale, kv.hadamard, kv.k_channel_scale,
                                              kv.v_channel_scale)
                  for p in meta.prefills]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
