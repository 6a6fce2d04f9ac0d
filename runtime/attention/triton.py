"""The `triton` attention backend: tessera's Triton kernels (`kernels/triton/`) for the whole
step. One store launch per layer (quantizing, rotating and smoothing 1-byte pages as the CPU
path does), one varlen paged-attention launch per layer for every decode and prefill/extend
chunk of the batch (`cu_seqlens_q`, one block table), split-K for all-decode steps with the
split count of the batch's bucket (MLA latent pages: the latent store and the MLA decode
kernel, one row per query token, `kernels/triton/launch_mla.py`), and the tag check as its
own batched device pass before the step (`triton_tags.DeviceTagIntegrityTracker`).

Runs natively on CUDA, and on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, how
the CPU suite tests it). Needs the `cuda` extra (triton).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.triton import launch, launch_mla
from kernels.triton.cuda_ops import decode_splits
from runtime.attention.backend import AttentionBackend, BatchLayout
from runtime.attention.pure_torch import TorchAttentionBackend
from runtime.context import AttentionMetadata
from runtime.errors import InvalidArgument
from runtime.extras import require_extra
from runtime.kv.cache import LayerKV
from runtime.kv.pages import PagePool


@dataclass
class TritonMetadata(AttentionMetadata):
    """The step for the Triton kernels (no per-sequence groups: `decodes` and `prefills`
    stay empty). Tensors on the engine's device."""

    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32
    seq_lens: torch.Tensor | None = None  # [B] int32: tokens with KV once this step is written
    block_table: torch.Tensor | None = None  # [B, max_pages] long
    max_seqlen_q: int = 0
    num_decodes: int = 0
    batch_bucket: int = 1  # num sequences rounded up to a power of two
    seq_valid: torch.Tensor | None = None  # [B] int32: the tag pass's flags (0: no KV read)


def masked_slots(slots: torch.Tensor, seq_valid: torch.Tensor,
                 query_lens: list[int]) -> torch.Tensor:
    """slots [T] with -1 for every token of a sequence whose flag (seq_valid [B]) is 0; a
    device op (no host read). query_lens: [B] tokens per sequence, summing to T."""
    if len(query_lens) == slots.shape[0]:  # one token each (decodes)
        token_valid = seq_valid
    else:
        counts = torch.tensor(query_lens, device=seq_valid.device)
        token_valid = seq_valid.repeat_interleave(counts, output_size=slots.shape[0])
    return torch.where(token_valid != 0, slots, torch.full_like(slots, -1))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    runs_fused_decode = False
    # NOTE: kernels and grids are capture-safe (no host sync, grids by bucket); `build_metadata`
    # builds fresh tensors each step, so only runtime/decode_graphs.py's static buffers
    # (`static_decode_metadata`) may be captured: that runner sets this True when it is used
    cuda_graph_safe = False

    def __init__(self, device: torch.device) -> None:
        require_extra("cuda", "triton", what="attention_backend 'triton'")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise InvalidArgument("attention_backend 'triton' on CPU runs only in Triton's "
                                  "interpreter: set TRITON_INTERPRET=1 before starting",
                                  field="attention_backend")
        self.device = device
        # metadata built by hand (load-time calibration over a scratch cache, not a step):
        # the torch twins, as `backend_of` gives such contexts
        self.reference = TorchAttentionBackend(device)

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        n = layout.num_sequences
        seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int32, device=self.device)
        slots = layout.slot_mapping
        if layout.seq_valid is not None:  # a failed sequence writes no KV either (slot -1)
            slots = masked_slots(slots, layout.seq_valid, layout.query_lens)
        return TritonMetadata(
            slots, [], [], cu_seqlens_q=layout.cu_seqlens_q.to(torch.int32),
            seq_lens=seq_lens, block_table=layout.block_table,
            max_seqlen_q=max(layout.query_lens, default=0), num_decodes=layout.num_decodes,
            batch_bucket=1 << max(0, (n - 1).bit_length()), seq_valid=layout.seq_valid)

    def static_decode_metadata(self, slots: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               seq_lens: torch.Tensor, block_table: torch.Tensor,
                               seq_valid: torch.Tensor, bucket: int) -> TritonMetadata:
        """An all-decode step of `bucket` rows from fixed buffers alone (what a CUDA graph
        captures; runtime/decode_graphs.py): slots [bucket] long (a row whose flag in
        seq_valid [bucket] int32 is 0 writes nothing), cu_seqlens_q [bucket + 1] int32,
        seq_lens [bucket], block_table [bucket, max_pages] long."""
        return TritonMetadata(
            slots.masked_fill(seq_valid == 0, -1), [], [], cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens, block_table=block_table, max_seqlen_q=1, num_decodes=bucket,
            batch_bucket=bucket, seq_valid=seq_valid)

    def store_kv(self, meta: AttentionMetadata, kv: LayerKV, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        if not isinstance(meta, TritonMetadata):
            self.reference.store_kv(meta, kv, k, v)
            return
        assert kv.v is not None, "K/V pages (MLA latent pages have their own layer)"
        launch.store_kv(k.contiguous(), v.contiguous(), kv.k, kv.v, meta.slot_mapping,
                        kv.k_scale, kv.v_scale, kv.hadamard, kv.k_shift, kv.k_channel_scale,
                        kv.v_channel_scale)

    def attend(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
               scale: float) -> torch.Tensor:
        if not isinstance(meta, TritonMetadata):
            return self.reference.attend(meta, kv, q, scale)
        assert kv.v is not None
        assert meta.block_table is not None and meta.seq_lens is not None
        assert meta.cu_seqlens_q is not None
        all_decode = meta.max_seqlen_q == 1
        # split-K only where every row is a decode, sized by the bucket (not the lengths)
        splits = decode_splits(meta.batch_bucket, kv.k.shape[0], q.device) if all_decode else 1
        return launch.paged_attention(
            q.contiguous(), kv.k, kv.v, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
            scale, kv.k_scale, kv.v_scale, kv.hadamard, kv.k_channel_scale,
            kv.v_channel_scale, num_splits=splits, seq_valid=meta.seq_valid,
            max_seqlen_q=meta.max_seqlen_q)

    def store_latent(self, meta: AttentionMetadata, kv: LayerKV, latent: torch.Tensor) -> None:
        if not isinstance(meta, TritonMetadata):
            self.reference.store_latent(meta, kv, latent)
            return
        launch_mla.store_latent(latent.contiguous(), kv.k, meta.slot_mapping, kv.k_scale)

    def attend_latent(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
                      scale: float, kv_lora_rank: int) -> torch.Tensor:
        """One MLA decode row per query token (`launch_mla.mla_attention`): decode, prefill
        and extend in one launch, absorbed as on CPU; split-K only for all-decode steps, by
        the bucket (one latent "KV head")."""
        if not isinstance(meta, TritonMetadata):
            return self.reference.attend_latent(meta, kv, q, scale, kv_lora_rank)
        assert meta.block_table is not None and meta.seq_lens is not None
        assert meta.cu_seqlens_q is not None
        all_decode = meta.max_seqlen_q == 1
        splits = decode_splits(meta.batch_bucket, 1, q.device) if all_decode else 1
        return launch_mla.mla_attention(
            q.contiguous(), kv.k, kv.k_scale, meta.block_table, meta.seq_lens,
            meta.cu_seqlens_q, scale, kv_lora_rank, num_splits=splits,
            max_seqlen_q=meta.max_seqlen_q)

    def integrity_tracker(self, name: str, pool: PagePool) -> object:
        """`tags`: the batched device pass (`DeviceTagIntegrityTracker`); `off`: the no-op."""
        if name != "tags":
            return super().integrity_tracker(name, pool)
        from runtime.attention.triton_tags import DeviceTagIntegrityTracker

        return DeviceTagIntegrityTracker(pool, self.device)
