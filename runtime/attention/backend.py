"""The attention backend interface: what the model runner gives every backend (the scheduled
batch, varlen), and what a backend does with it (its own metadata, the KV store, attention).

Follows vLLM v1's attention backends (`v1/attention/backends/`: a backend and its metadata
builder over `CommonAttentionMetadata`) and mini-sglang's registry: the runner builds one
device-side description of the batch; each backend derives what its kernels need from it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from runtime.context import AttentionMetadata, DecodeGroup, PrefillSlice
from runtime.integrity import TRACKERS
from runtime.kv.cache import LayerKV
from runtime.kv.pages import PagePool


@dataclass(frozen=True)
class BatchLayout:
    """One step's sequences in flat-batch order, decodes (one query token each) first.

    Tensors are on the engine's device; the lists are their host copies (a backend's metadata
    builder reads those instead of syncing with the device).
    """

    num_decodes: int  # sequences [0, num_decodes) are single-token decodes
    page_size: int
    query_lens: list[int]  # [B] tokens this step computes per sequence
    seq_lens: list[int]  # [B] tokens with KV once this step is written (context per sequence)
    num_pages: list[int]  # [B] entries of each sequence's row of `block_table`
    cu_seqlens_q: torch.Tensor  # [B + 1] long: query token offsets into the flat batch
    cu_seqlens_k: torch.Tensor  # [B + 1] long: cumulative seq_lens
    block_table: torch.Tensor  # [B, max_pages] long page ids, rows padded with 0
    slot_mapping: torch.Tensor  # [T] long: flat KV slot (page_id * page_size + offset) per token
    # [B] int32: the device tag pass's flag per sequence (0: it failed; read and write no KV),
    # or None where the pages were checked on the host before the step
    seq_valid: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    def decode_group(self, start: int, end: int) -> DecodeGroup:
        """Decodes [start, end) as one group: their block-table rows cut to the group's widest
        row (contiguous), their context lengths."""
        width = max(self.num_pages[start:end])
        lens = torch.tensor(self.seq_lens[start:end], dtype=torch.long,
                            device=self.block_table.device)
        return DecodeGroup(start, end, self.block_table[start:end, :width].contiguous(), lens)

    def prefill_slices(self) -> list[PrefillSlice]:
        """One slice per prefill chunk: its tokens in the flat batch, its pages, and a causal
        mask offset by the tokens already cached (None when the chunk starts the sequence)."""
        slices: list[PrefillSlice] = []
        offset = self.num_decodes
        device = self.block_table.device
        for i in range(self.num_decodes, self.num_sequences):
            chunk, context_len = self.query_lens[i], self.seq_lens[i]
            start = context_len - chunk
            num_pages = -(-context_len // self.page_size)
            mask = None
            if start > 0:  # attends to earlier chunks: causal with an offset
                q_pos = torch.arange(start, context_len).unsqueeze(1)
                mask = (torch.arange(context_len).unsqueeze(0) <= q_pos).to(device)
            slices.append(PrefillSlice(offset, offset + chunk, self.block_table[i, :num_pages],
                                       context_len, mask))
            offset += chunk
        return slices


class AttentionBackend(abc.ABC):
    """Builds its metadata from a `BatchLayout`, stores K/V and attends, layer by layer.

    Capability flags: `runs_fused_decode` (it may run a whole step in one call,
    `run_fused_decode`), `cuda_graph_safe` (its metadata and kernels keep fixed addresses and
    shapes, so a step may be captured). Subclasses set `name` and override the three methods.
    """

    name = "base"
    runs_fused_decode = False
    cuda_graph_safe = False

    @abc.abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """This backend's metadata for the step `layout` describes."""

    @abc.abstractmethod
    def store_kv(self, meta: AttentionMetadata, kv: LayerKV, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, dim] written to the layer's pages at `meta.slot_mapping`."""

    @abc.abstractmethod
    def attend(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q: [T, heads, dim] (after this step's K/V are stored) -> [T, heads * dim]."""

    def store_latent(self, meta: AttentionMetadata, kv: LayerKV, latent: torch.Tensor) -> None:
        """MLA: latent [T, 1, latent_dim] (normalised c_kv, then roped k_pe) written to the
        layer's latent pages at `meta.slot_mapping` (`kernels/latent.py` has the row)."""
        from runtime.attention.latent import store_latent_rows

        store_latent_rows(meta, kv, latent)

    def attend_latent(self, meta: AttentionMetadata, kv: LayerKV, q: torch.Tensor,
                      scale: float, kv_lora_rank: int) -> torch.Tensor:
        """MLA in the absorbed form: q [T, heads, latent_dim] (q_nope through W_UK, then q_pe),
        after this step's latents are stored -> [T, heads, kv_lora_rank], softmax(scale *
        q . latent) @ c_kv. The default runs the step's groups through the paged ops."""
        from runtime.attention.latent import attend_latent_groups

        return attend_latent_groups(meta, kv, q, scale, kv_lora_rank)

    def run_fused_decode(self, model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, kv_cache: object) -> torch.Tensor | None:
        """The last layer's hidden states [T, hidden] for a step run in one call (the CPU
        backend's covers prefill chunks too), or None where this backend has no fused step for
        `model` or this step (its layers run instead)."""
        return None

    def integrity_tracker(self, name: str, pool: PagePool) -> object:
        """The page integrity tracker `name` (runtime/integrity.py TRACKERS) over `pool` for
        steps on this backend: the host's batched check unless a backend runs its own pass."""
        return TRACKERS[name](pool)
