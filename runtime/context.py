"""Per-step attention metadata, set once by the model runner and read by every attention layer.

One scoped context instead of threading metadata through every `forward`; nesting is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefillSlice:
    """One sequence's prefill chunk: tokens [start, end) of the flat batch."""

    start: int
    end: int
    page_ids: torch.Tensor  # [num_pages] long
    context_len: int  # tokens with KV after this chunk is written
    mask: torch.Tensor | None  # [chunk, context_len] bool, None when plain causal (no history)


@dataclass
class DecodeGroup:
    """Single-token steps [start, end) of the flat batch with similar context lengths, so
    padding every sequence to the group's longest costs little."""

    start: int
    end: int
    page_table: torch.Tensor  # [end - start, max_pages] long
    context_lens: torch.Tensor  # [end - start] long: tokens each sequence attends to


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat KV slot (page_id * page_size + offset) per token
    decodes: list[DecodeGroup]  # cover tokens [0, num_decode) in order
    prefills: list[PrefillSlice]


@dataclass
class ForwardContext:
    attn: AttentionMetadata  # built by `backend` (AttentionBackend.build_metadata)
    kv_cache: object  # runtime.kv.cache.KVCache; typed loosely to keep this module light
    # runtime.attention.AttentionBackend, which stores K/V and attends; None: the `torch`
    # reference backend (for callers that build their metadata by hand), see
    # runtime.attention.backend_of
    backend: Any = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already set: nested forwards are not supported")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward_context: the model runs only inside ModelRunner.execute")
    return _current
